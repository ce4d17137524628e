"""``RowStream`` (pyarrow.flight) against the binary's ``--serve-rows``, the engine in a
process of its own as a remote trainer meets it: every group once and equal to ``--out``,
a reader killed mid-stream losing and duplicating nothing, an engine killed and resumed
continuing from the acknowledged position, a wrong token refused, four readers splitting
the groups."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from async_grpo import RowStream

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "examples" / "quickstart"
# A self-signed certificate for localhost and 127.0.0.1 (the binary's tests' own).
TLS = ROOT / "crates" / "cli" / "tests" / "fixtures" / "tls"


class Engine:
    """``async-grpo rollout --serve-rows`` on the simulator, in `directory`."""

    def __init__(
        self,
        binary: str,
        directory: Path,
        groups: int,
        capacity: int,
        token: str | None = None,
        resume: bool = False,
        tls: bool = False,
        settings: str = "",
        tables: str = "",
    ) -> None:
        config = directory / "run.toml"
        config.write_text(
            f'dataset = "{QUICKSTART / "arithmetic.jsonl"}"\ntokenizer = "{QUICKSTART}"\n'
            f'num_generations = 4\ngroups = {groups}\nout = "rows.jsonl"\n'
            f'serve_rows = "127.0.0.1:0"\nserve_rows_capacity = {capacity}\nprogress = "off"\n'
            + settings
            + (f'serve_rows_cert = "{TLS / "cert.pem"}"\nserve_rows_key = "{TLS / "key.pem"}"\n' if tls else "")
            + '[[rewards]]\nspec = "numeric:answer"\n'
            + tables
        )
        env = dict(os.environ)
        if token:
            env["ASYNC_GRPO_ROWS_TOKEN"] = token
        self.process = subprocess.Popen(
            [binary, "rollout", "--config", str(config), "--resume" if resume else "--overwrite"],
            cwd=directory,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.out = directory / "rows.jsonl"
        assert self.process.stderr is not None
        self.url = ""
        for line in self.process.stderr:
            found = re.search(r"serving rows on (\S+)", line)
            if found:
                self.url = ("grpc+tls://" if tls else "grpc://") + found.group(1)
                break
        assert self.url, "the engine never said where it serves rows"
        # The rest of stderr, drained so the engine never blocks on it.
        threading.Thread(target=self.process.stderr.read, daemon=True).start()

    def wait(self) -> int:
        return self.process.wait(timeout=120)

    def out_groups(self) -> dict[int, int]:
        groups: dict[int, int] = {}
        for line in self.out.read_text().splitlines():
            group = json.loads(line)["group_id"]
            groups[group] = groups.get(group, 0) + 1
        return groups


def group_id(rows: Any) -> int:
    ids = rows.column("group_id").to_numpy()
    assert (ids == ids[0]).all(), "a batch of two groups"
    return int(ids[0])


def test_every_group_arrives_once_with_the_rows_of_out(binary: str, tmp_path: Path) -> None:
    engine = Engine(binary, tmp_path, groups=10, capacity=2)
    streamed: dict[int, int] = {}
    with RowStream(engine.url, timeout=60) as stream:
        stream.update_model_version(2)
        for count, group in enumerate(stream):
            if count == 1:
                # A weight update's handshake: admission stops, the version moves, it resumes.
                assert stream.pause("wait")["paused"] is True
                stream.update_model_version(3)
                stream.resume()
            gid = group_id(group.rows)
            assert gid not in streamed, f"group {gid} twice"
            streamed[gid] = group.rows.num_rows
            assert group.rows.schema.metadata[b"async_grpo.rows_schema"] == b"1"
            # Zero-copy into NumPy: the token ids of the first row.
            assert group.rows.column("input_ids")[0].values.to_numpy().size > 0
            assert stream.ack(group) == 1
    assert engine.wait() == 0
    assert streamed == engine.out_groups()
    assert len(streamed) == 10


def _read_then_die(url: str, acknowledged: Any, ready: Any) -> None:
    """A trainer that acknowledges its first group, reads two more, then is killed."""
    stream = RowStream(url, timeout=60)
    for count, group in enumerate(stream):
        if count == 0:
            stream.ack(group)
            acknowledged.put(group_id(group.rows))
            # Flushed to the parent before anything can kill this process.
            acknowledged.close()
            acknowledged.join_thread()
        if count == 2:
            ready.set()
            threading.Event().wait()  # until killed


def test_a_reader_killed_mid_stream_loses_and_duplicates_nothing(binary: str, tmp_path: Path) -> None:
    engine = Engine(binary, tmp_path, groups=8, capacity=4)
    context = multiprocessing.get_context("spawn")
    acknowledged = context.Queue()
    ready = context.Event()
    reader = context.Process(target=_read_then_die, args=(engine.url, acknowledged, ready))
    reader.start()
    assert ready.wait(60), "the first reader never read three groups"
    reader.kill()
    reader.join()
    first = acknowledged.get(timeout=10)
    rest: list[int] = []
    with RowStream(engine.url, timeout=60) as stream:
        for group in stream:
            rest.append(group_id(group.rows))
            stream.ack(group)
    assert engine.wait() == 0
    assert first not in rest, "an acknowledged group delivered again"
    assert sorted([first, *rest]) == sorted(engine.out_groups()), "a group lost or twice"


def test_an_engine_killed_and_resumed_continues_from_the_acknowledged_position(
    binary: str, tmp_path: Path
) -> None:
    engine = Engine(binary, tmp_path, groups=10, capacity=3)
    acknowledged: dict[int, int] = {}
    with RowStream(engine.url, timeout=60) as stream:
        for count, group in enumerate(stream):
            if count < 3:
                stream.ack(group)
                acknowledged[group.position] = group_id(group.rows)
            if count == 4:
                break
    assert sorted(acknowledged) == [0, 1, 2]
    engine.process.kill()  # no drain, no goodbye: a crash
    engine.process.wait()

    resumed = Engine(binary, tmp_path, groups=10, capacity=3, resume=True)
    rest: dict[int, int] = {}
    with RowStream(resumed.url, timeout=60) as stream:
        for group in stream:
            assert group.position not in acknowledged, f"{group.position} acknowledged, delivered again"
            assert group.position not in rest, f"{group.position} twice"
            rest[group.position] = group_id(group.rows)
            stream.ack(group)
    assert resumed.wait() == 0
    assert min(rest) == 3, "the resumed stream starts where the acknowledgements stop"
    streamed = [*acknowledged.values(), *rest.values()]
    assert sorted(streamed) == sorted(resumed.out_groups()), "a group lost or twice"
    assert len(streamed) == 10


def test_a_wrong_token_gets_nothing(binary: str, tmp_path: Path) -> None:
    import pyarrow.flight as flight

    engine = Engine(binary, tmp_path, groups=2, capacity=2, token="s3cret")
    for token in (None, "wrong"):
        with pytest.raises(flight.FlightUnauthenticatedError):
            next(iter(RowStream(engine.url, token, timeout=60)))
    with RowStream(engine.url, "s3cret", timeout=60) as stream:
        for group in stream:
            stream.ack(group)
    assert engine.wait() == 0


def test_over_tls_with_the_certificate_trusted_and_not_without(binary: str, tmp_path: Path) -> None:
    import pyarrow.flight as flight

    engine = Engine(binary, tmp_path, groups=3, capacity=2, tls=True)
    assert engine.url.startswith("grpc+tls://")
    plain = engine.url.replace("grpc+tls://", "grpc://")
    with pytest.raises(flight.FlightUnavailableError):
        next(iter(RowStream(plain, timeout=10)))
    with pytest.raises(flight.FlightUnavailableError):
        # TLS, the certificate not trusted (self-signed).
        next(iter(RowStream(engine.url, timeout=10)))
    seen = []
    with RowStream(engine.url, timeout=60, ca=TLS / "cert.pem") as stream:
        for group in stream:
            seen.append(group_id(group.rows))
            stream.ack(group)
    assert engine.wait() == 0
    assert sorted(seen) == sorted(engine.out_groups())


def _read_all(url: str, out: Any, ready: Any) -> None:
    seen = []
    with RowStream(url, timeout=60) as stream:
        ready.set()  # connecting as it iterates
        for group in stream:
            seen.append(group_id(group.rows))
            stream.ack(group)
    out.put(seen)


def _paused(url: str) -> RowStream:
    """A connection to the engine that has paused its admission (retried while it starts)."""
    import pyarrow.flight as flight

    control = RowStream(url, timeout=60)
    for _ in range(600):
        try:
            control.pause("wait")
            return control
        except flight.FlightUnavailableError as error:  # UNAVAILABLE: the run is starting
            assert "starting" in str(error), error
            time.sleep(0.1)
    raise AssertionError("the run never started")


def test_four_readers_split_the_groups_with_none_twice(binary: str, tmp_path: Path) -> None:
    # One group at a time, each 100 ms of simulated sampling: the run lasts while the readers
    # read, and the engine is paused until all four are there.
    engine = Engine(
        binary,
        tmp_path,
        groups=24,
        capacity=4,
        settings="max_inflight = 4\n",
        tables='[simulator]\nlatency = "100ms"\n',
    )
    control = _paused(engine.url)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    ready = [context.Event() for _ in range(4)]
    readers = [context.Process(target=_read_all, args=(engine.url, out, r)) for r in ready]
    for reader in readers:
        reader.start()
    for event in ready:
        assert event.wait(60), "a reader never started"
    time.sleep(1)  # their streams opened
    control.resume()
    control.close()
    per_reader: list[list[int]] = []
    for _ in readers:
        per_reader.append(out.get(timeout=120))
    for reader in readers:
        reader.join(timeout=30)
    assert engine.wait() == 0
    seen = [group for groups in per_reader for group in groups]
    assert sorted(seen) == sorted(engine.out_groups()), "a group lost or twice"
    assert len(seen) == 24
    assert sum(1 for groups in per_reader if groups) >= 2, f"one reader took every group: {per_reader}"
