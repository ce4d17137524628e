"""``RolloutWorker(serve_rows=...)``: the worker's groups, with Python tools and rewards,
served over the row stream to a ``RowStream`` reader in another process, as the binary's
``--serve-rows`` serves them: every group once and equal to ``output``, the trainer's model
version reaching the engine, admission held while nobody reads and a stop that does not wait
for the reader, a wrong token refused, settings refused at construction naming the argument."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from async_grpo import RowStream

ROOT = Path(__file__).resolve().parents[3]
# A self-signed certificate for localhost and 127.0.0.1 (the binary's tests' own).
TLS = ROOT / "crates" / "cli" / "tests" / "fixtures" / "tls"


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: Two integers and an operator, such as "3 + 4".
    """
    return f"streamed:{expression}"


def answer_length(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
    """A Python reward: the length of each last message, as the rows must carry it."""
    return [float(len(c[-1]["content"])) for c in completions]


def _read_all(url: str, token: str | None, version: int | None, out: Any) -> None:
    """A trainer in a process of its own: sends `version` first, then reads, acknowledges
    and reports every group (its position, group id, rows' token ids and rewards)."""
    seen = []
    with RowStream(url, token, timeout=60) as stream:
        if version is not None:
            stream.update_model_version(version)
        for group in stream:
            rows = group.rows.to_pylist()
            seen.append(
                {
                    "position": group.position,
                    "group_id": rows[0]["group_id"],
                    "input_ids": [row["input_ids"] for row in rows],
                    "rewards": [json.loads(row["rewards"]) for row in rows],
                }
            )
            stream.ack(group)
    out.put(seen)


def read_in_another_process(url: str, token: str | None = None, version: int | None = None) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    reader = context.Process(target=_read_all, args=(url, token, version, out))
    reader.start()
    try:
        return out.get(timeout=120)
    finally:
        reader.join(30)
        if reader.is_alive():
            reader.kill()


def out_groups(path: Path) -> dict[int, list[list[int]]]:
    groups: dict[int, list[list[int]]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        groups.setdefault(row["group_id"], []).append(row["input_ids"])
    return groups


def test_a_worker_serves_each_group_once_with_the_rows_of_its_output(simulator, make_worker, tmp_path: Path) -> None:
    sim = simulator(tool_rounds=1, tool_name="calculator")
    out = tmp_path / "rows.jsonl"
    worker = make_worker(
        sim,
        tools=[calculator],
        reward_funcs=[answer_length],
        epochs=1,
        output=out,
        serve_rows="0",
        serve_rows_capacity=2,
    )
    worker.start()
    assert worker.rows_url is not None and worker.rows_url.startswith("grpc://127.0.0.1:")
    streamed = read_in_another_process(worker.rows_url, version=7)
    assert worker.join(60), "the run did not end once its groups were read"
    assert worker.stats()["model_version"] == 7, "the trainer's version never reached the engine"
    worker.stop()
    assert worker.report["rows_unacknowledged"] == 0
    assert worker.rollout_buffer.empty(), "a group went to TRL's buffer as well"

    assert [g["position"] for g in streamed] == list(range(8))
    by_group = {g["group_id"]: g["input_ids"] for g in streamed}
    assert len(by_group) == 8, "a group twice"
    assert by_group == out_groups(out)
    assert worker.delivered == sum(len(ids) for ids in by_group.values())
    # The Python reward's values are the rows' (through the worker processes, not the GIL).
    rewards = [r for g in streamed for r in g["rewards"]]
    assert all(set(r) == {"answer_length"} and r["answer_length"] > 0 for r in rewards), rewards
    # The Python tool's answers are in the rows' conversations.
    for line in out.read_text().splitlines():
        tool_messages = [m for m in json.loads(line)["completion"] if m["role"] == "tool"]
        assert tool_messages and tool_messages[0]["content"].startswith("streamed:"), tool_messages


def test_a_resumed_worker_serves_again_what_no_trainer_acknowledged(simulator, make_worker, tmp_path: Path) -> None:
    sim = simulator(tool_rounds=0)
    out = tmp_path / "rows.jsonl"
    options: dict[str, Any] = {"groups": 6, "output": out, "serve_rows": "0", "serve_rows_capacity": 2}
    first = make_worker(sim, drain_timeout=1.0, **options)
    first.start()
    assert first.rows_url is not None
    acknowledged: dict[int, int] = {}
    with RowStream(first.rows_url, timeout=60) as stream:
        for count, group in enumerate(stream):
            if count < 2:
                stream.ack(group)
                acknowledged[group.position] = group.rows.column("group_id")[0].as_py()
            if count == 3:
                break  # two more read, not acknowledged: given back when the stream closes
    first.stop()
    assert sorted(acknowledged) == [0, 1]
    assert first.report["rows_unacknowledged"] >= 2
    assert (tmp_path / "rows.jsonl.acks").read_text().split() == ["0", "1"]

    second = make_worker(sim, resume=True, **options)
    second.start()
    assert second.rows_url is not None
    rest = read_in_another_process(second.rows_url)
    assert second.join(60)
    positions = [g["position"] for g in rest]
    assert not set(positions) & set(acknowledged), "an acknowledged group delivered again"
    assert len(positions) == len(set(positions)), "a group twice"
    assert positions[:2] == [2, 3], "the given-back groups first, at their positions"
    streamed = sorted([*acknowledged.values(), *(g["group_id"] for g in rest)])
    assert streamed == sorted(out_groups(out)), "a group lost or twice"
    assert len(streamed) == 6


def test_nobody_reading_holds_admission_and_a_stop_does_not_wait_for_a_reader(
    simulator, make_worker, tmp_path: Path
) -> None:
    sim = simulator(tool_rounds=0)
    out = tmp_path / "rows.jsonl"
    worker = make_worker(
        sim,
        epochs=1,
        output=out,
        serve_rows="0",
        serve_rows_capacity=1,
        max_inflight_tasks=4,
        drain_timeout=1.0,
    )
    worker.start()
    # One group held by the stream, one the pump pushes, one in the engine's buffer and the
    # rest of the rollouts stopped: far from the 8 groups of the epoch.
    time.sleep(3)
    completions = sim.completions()
    time.sleep(1)
    assert sim.completions() == completions, "admission went on with nobody reading"
    assert completions < 8 * 4
    assert not worker.join(0.5)
    # On a thread of its own, so that a stop waiting on the reader fails here, not hangs.
    stopping = threading.Thread(target=worker.stop, daemon=True)
    stopping.start()
    stopping.join(20)
    assert not stopping.is_alive(), "stop() waited on the reader"
    assert worker.report["rows_unacknowledged"] == 1
    # What was rolled out is in the file, to resume from.
    assert len(out_groups(out)) >= 1


def test_a_wrong_token_gets_nothing_and_the_right_one_everything(simulator, make_worker) -> None:
    import pyarrow.flight as flight

    sim = simulator(tool_rounds=0)
    worker = make_worker(sim, groups=2, serve_rows="0", serve_rows_token="s3cret")
    worker.start()
    assert worker.rows_url is not None
    for token in (None, "wrong"):
        with pytest.raises(flight.FlightUnauthenticatedError):
            next(iter(RowStream(worker.rows_url, token, timeout=30)))
    streamed = read_in_another_process(worker.rows_url, "s3cret")
    assert worker.join(60)
    assert len(streamed) == 2


def test_over_tls_with_the_certificate(simulator, make_worker) -> None:
    sim = simulator(tool_rounds=0)
    worker = make_worker(
        sim,
        groups=2,
        serve_rows="0",
        serve_rows_cert=TLS / "cert.pem",
        serve_rows_key=TLS / "key.pem",
    )
    worker.start()
    assert worker.rows_url is not None and worker.rows_url.startswith("grpc+tls://")
    seen = []
    with RowStream(worker.rows_url, timeout=60, ca=TLS / "cert.pem") as stream:
        for group in stream:
            seen.append(group.position)
            stream.ack(group)
    assert worker.join(60)
    assert seen == [0, 1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"serve_rows": "0.0.0.0:0"}, "serve_rows: 0.0.0.0:0 is reachable from other machines"),
        ({"serve_rows": "nowhere"}, "serve_rows: 'nowhere' is not an address to listen on"),
        ({"serve_rows": "0", "serve_rows_token": ""}, "serve_rows_token: the row stream's token"),
        ({"serve_rows": "0", "serve_rows_capacity": 0}, "serve_rows_capacity must be at least 1"),
        ({"serve_rows": "0", "serve_rows_cert": TLS / "cert.pem"}, "serve_rows_cert: needs serve_rows_key"),
        (
            {"serve_rows": "0", "serve_rows_cert": TLS / "key.pem", "serve_rows_key": TLS / "key.pem"},
            "serve_rows_cert: " + str(TLS / "key.pem") + " holds no PEM certificate",
        ),
        ({"serve_rows_token": "s3cret"}, "serve_rows_token: a setting of the row stream, but no serve_rows"),
    ],
)
def test_a_row_stream_setting_that_cannot_serve_is_refused_naming_it(
    simulator, make_worker, options: dict[str, Any], message: str
) -> None:
    sim = simulator()
    with pytest.raises(ValueError) as raised:
        make_worker(sim, **options)
    assert message in str(raised.value)
