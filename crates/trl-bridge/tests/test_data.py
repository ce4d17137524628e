"""What the worker rolls out and where its groups go: datasets in memory or in a file (JSON
Lines, Parquet), epochs, shuffle, shards, the output and a worker resuming it after
``stop()``; and the settings mapping the worker hands the engine."""

from __future__ import annotations

import json
import queue
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import async_grpo
from conftest import take

GENERATIONS = 4  # the suite's num_generations


def drain(worker: async_grpo.RolloutWorker) -> list[Any]:
    samples = []
    while True:
        try:
            samples.append(worker.rollout_buffer.get_nowait())
        except queue.Empty:
            return samples


def row_of(sample: Any) -> int:
    """The dataset row a sample's prompt came from (``Row I: ...``)."""
    match = re.match(r"Row (\d+):", sample.prompt[0]["content"])
    assert match, sample.prompt
    return int(match.group(1))


def groups_of(samples: list[Any]) -> dict[int, int]:
    """Group id -> the row it rolled out, checking each group's samples share one row."""
    rows: dict[int, set[int]] = {}
    for sample in samples:
        rows.setdefault(sample.group_id, set()).add(row_of(sample))
    assert all(len(r) == 1 for r in rows.values()), rows
    return {group: r.pop() for group, r in rows.items()}


def prompts(count: int) -> list[dict[str, Any]]:
    return [{"prompt": f"Row {i}: what is {i} + 1?"} for i in range(count)]


def output_group_ids(path: Path) -> list[int]:
    """The group id of every training row of an output (Parquet read with pyarrow)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return [int(g) for g in pq.read_table(path).column("group_id").to_pylist()]
    return [json.loads(line)["group_id"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("out", ["groups.parquet", "groups.jsonl"])
def test_a_shuffled_parquet_shard_stopped_then_resumed_rolls_out_each_group_of_it_once(
    simulator, make_worker, tmp_path: Path, out: str
) -> None:
    pa = pytest.importorskip("pyarrow", reason="the Parquet dataset is written with pyarrow")
    import pyarrow.parquet as pq

    rows, epochs = 10, 2
    dataset = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(prompts(rows)), dataset)
    output = tmp_path / out
    # One group in flight at a time, 250 ms a turn: the first worker stops with groups left,
    # also on a machine busy enough to stall this process for a second (50 ms was not).
    sim = simulator(latency="250ms")
    options: dict[str, Any] = {
        "dataset": str(dataset),
        "epochs": epochs,
        "shuffle": True,
        "seed": 11,
        "shard": "1/2",
        "output": str(output),
        "max_inflight_tasks": GENERATIONS,
    }
    # What shard 1/2 holds: each pass's rows whose index modulo 2 is 1 (8 groups in all).
    shard_rows = [i for i in range(rows) if i % 2 == 1]
    total = epochs * len(shard_rows)

    first = make_worker(sim, **options)
    first.start()
    taken = take(first, 2 * GENERATIONS)
    first.stop()
    first_samples = taken + drain(first)
    first_groups = groups_of(first_samples)
    assert first.report["output_groups"] == len(first_groups), first.report
    assert output.is_file() and not Path(f"{output}.partial.jsonl").exists()
    assert 2 <= len(first_groups) < total, "the first worker stopped with groups left"

    second = make_worker(sim, resume=True, **options)
    second.start()
    taken = take(second, (total - len(first_groups)) * GENERATIONS)
    second.stop()
    second_samples = taken + drain(second)
    second_groups = groups_of(second_samples)

    assert not first_groups.keys() & second_groups.keys(), "the second worker delivered only new groups"
    counts = Counter(s.group_id for s in first_samples + second_samples)
    assert set(counts.values()) == {GENERATIONS}, f"no group delivered twice: {counts}"
    groups = {**first_groups, **second_groups}
    for epoch in range(epochs):
        # A group's id is its place in the run: epoch * rows + position in the pass.
        in_pass = {group: row for group, row in groups.items() if group // rows == epoch}
        assert sorted(in_pass.values()) == shard_rows, (epoch, in_pass)
    assert any(group % rows != row for group, row in groups.items()), f"shuffled: {groups}"
    assert sorted(Counter(output_group_ids(output)).items()) == sorted(counts.items())


@pytest.mark.parametrize("epochs", [3, None])
def test_rows_in_memory_take_a_shard_in_order_pass_after_pass(simulator, make_worker, epochs) -> None:
    sim = simulator()
    worker = make_worker(
        sim, dataset=prompts(8), shard=(0, 4), epochs=epochs, max_inflight_tasks=GENERATIONS
    )
    worker.start()
    taken = take(worker, 6 * GENERATIONS)
    worker.stop()
    groups = groups_of(taken + drain(worker))
    # Rows 0 and 4 of each pass, unshuffled: group id = pass * 8 + row.
    first_six = {p * 8 + r: r for p in range(3) for r in (0, 4)}
    assert first_six.items() <= groups.items(), groups
    if epochs is not None:
        assert groups == first_six, "three passes, then the run ends"
    else:
        assert all(group % 8 == row and row in (0, 4) for group, row in groups.items()), groups


def test_an_existing_output_is_continued_with_resume_and_never_replaced(simulator, make_worker, tmp_path) -> None:
    output = tmp_path / "groups.jsonl"
    output.write_text("not a training row\nnor this\n")
    sim = simulator()
    with pytest.raises(ValueError, match="output: .*holds rows; pass resume=True"):
        make_worker(sim, output=str(output))
    with pytest.raises(ValueError, match="output: .*not a training row"):
        make_worker(sim, output=str(output), resume=True)


BAD_ARGUMENTS = [
    ({"shard": "1/1"}, ValueError, "shard"),
    ({"shard": "one of two"}, ValueError, "shard"),
    ({"shard": (2, 2)}, ValueError, "shard"),
    ({"shard": "9/10"}, ValueError, "shard"),  # the suite's 8 rows leave it empty
    ({"shard": ("1", 2)}, TypeError, "shard"),
    ({"shuffle": "yes"}, TypeError, "shuffle"),
    ({"resume": True}, ValueError, "resume"),
    ({"output": 42}, TypeError, "output"),
    ({"dataset": "missing.parquet"}, ValueError, "dataset"),
]


@pytest.mark.parametrize(("options", "error", "names"), BAD_ARGUMENTS, ids=[str(b[0]) for b in BAD_ARGUMENTS])
def test_a_wrong_plan_argument_fails_at_construction_naming_it(
    simulator, make_worker, options: dict[str, Any], error: type[Exception], names: str
) -> None:
    sim = simulator()
    with pytest.raises(error, match=names):
        make_worker(sim, **options)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"max_inflight_taskz": 4}, r"unknown key `max_inflight_taskz`, expected one of .*`max_inflight_tasks`"),
        ({"max_total_tokens": "lots"}, r"max_total_tokens: invalid type"),
        ({"shard": "2/2"}, r"shard: expected I/N"),
    ],
)
def test_the_engine_names_a_settings_key_it_does_not_know_or_cannot_read(
    simulator, make_worker, monkeypatch, extra: dict[str, Any], message: str
) -> None:
    # The mapping is the worker's to build; a key added to it reaches the engine as is.
    native = async_grpo._worker._native
    real = native.Engine

    def engine(**arguments: Any) -> Any:
        return real(**{**arguments, "settings": {**arguments["settings"], **extra}})

    monkeypatch.setattr(native, "Engine", engine)
    sim = simulator()
    with pytest.raises(ValueError, match=message):
        make_worker(sim)
