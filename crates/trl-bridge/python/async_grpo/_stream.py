"""``RowStream``: training rows read live from an engine that serves them
(``async-grpo rollout --serve-rows ADDR``), over Apache Arrow Flight, by any trainer.

Each group arrives as one ``pyarrow.RecordBatch`` whose schema is the rows' (the Parquet
output's: ``group_id``, ``input_ids``, ``completion_mask``, ``old_log_probs``, ``advantage``,
``token_versions``...), its columns readable as NumPy arrays without a copy. A group stays
the engine's until it is acknowledged (``ack``); a stream closed before that gives it back,
and the next reader gets it. Several readers (data-parallel ranks) may read one engine: each
group goes to one of them. Needs ``pyarrow`` (``pip install pyarrow``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StreamedGroup:
    """One group of training rows as the stream delivered it."""

    position: int
    """The group's place in the stream: its place among the run's output's groups, the same
    after the engine is killed and resumed (``--resume``)."""
    rows: Any
    """The rows, a ``pyarrow.RecordBatch``."""
    reader: int
    """The reader the stream was opened as."""


class RowStream:
    """Training rows served by an engine at ``url`` (``grpc://HOST:PORT``, or
    ``grpc+tls://HOST:PORT`` when it serves TLS: ``--serve-rows-cert``), with the bearer
    ``token`` it was given (``--serve-rows-token``), if any. ``ca`` is a PEM file of the
    certificates to trust for TLS besides the system's (a self-signed certificate's own).

    Iterate it for ``StreamedGroup``s as groups complete; the iteration ends when the run
    does. ``ack(group)`` acknowledges a group and every earlier one this stream received;
    ``update_model_version(version)`` tells the engine the trainer's new policy version, as
    ``RolloutWorker.update_model_version`` does in process; ``pause()`` and ``resume()``
    stop and restart the engine's admission around a weight update. ``timeout`` (seconds),
    when given, bounds each call, the whole stream included: for a job that must end.

    An engine killed and restarted with ``--resume`` serves again, first, the groups of its
    output no trainer acknowledged, at their positions: a trainer that keeps the positions it
    trained on skips any it sees twice (one read and not acknowledged before the kill)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float | None = None,
        ca: str | os.PathLike[str] | None = None,
    ) -> None:
        import pyarrow.flight as flight

        self._flight = flight
        if ca is not None:
            with open(ca, "rb") as file:
                self._client = flight.FlightClient(url, tls_root_certs=file.read())
        else:
            self._client = flight.FlightClient(url)
        headers = [(b"authorization", b"Bearer " + token.encode())] if token else []
        self._options = flight.FlightCallOptions(headers=headers, timeout=timeout)
        self._reader: Any = None

    def __iter__(self) -> Iterator[StreamedGroup]:
        if self._reader is not None:
            raise RuntimeError("a RowStream is iterated once; make another to read again")
        self._reader = self._client.do_get(self._flight.Ticket(b"rows"), self._options)
        while True:
            try:
                chunk = self._reader.read_chunk()
            except StopIteration:
                return
            if chunk.data is None:
                continue
            place = json.loads(chunk.app_metadata.to_pybytes())
            yield StreamedGroup(position=int(place["position"]), rows=chunk.data, reader=int(place["reader"]))

    def ack(self, group: StreamedGroup) -> int:
        """Acknowledges ``group`` and every earlier group this stream received and did not
        acknowledge: they are the trainer's now. How many."""
        body = json.dumps({"reader": group.reader, "through": group.position}).encode()
        answer = self._action("ack", body)
        return int(answer["acknowledged"])

    def update_model_version(self, version: int) -> None:
        """The trainer's policy is now ``version``: turns the engine samples from now on
        record it (versions only grow)."""
        self._action("model_version", json.dumps({"version": int(version)}).encode())

    def pause(self, mode: str | None = None) -> dict[str, Any]:
        """Stops the engine's admission, answering once it has: ``mode`` is what happens to
        the rollouts in flight (``"wait"``: they finish; ``"abort"``: dropped;
        ``"continue"``: interrupted, continued after the resume), the run's ``in_flight``
        when not given. The engine's answer: ``paused``, ``in_flight``, ``queued``. While the
        run is starting (waiting for its servers) it raises ``pyarrow.flight.FlightUnavailableError``:
        try again; ``resume`` likewise."""
        body = json.dumps({"mode": mode}).encode() if mode is not None else b""
        return self._action("pause", body)

    def resume(self) -> None:
        """Starts the engine's admission again (post the new version first)."""
        self._action("resume", b"")

    def close(self) -> None:
        """Closes the stream: the groups it received and did not acknowledge go back to the
        engine, for the next reader."""
        if self._reader is not None:
            self._reader.cancel()
        self._client.close()

    def __enter__(self) -> RowStream:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _action(self, kind: str, body: bytes) -> dict[str, Any]:
        results = list(self._client.do_action(self._flight.Action(kind, body), self._options))
        answer: dict[str, Any] = json.loads(results[0].body.to_pybytes()) if results else {}
        return answer
