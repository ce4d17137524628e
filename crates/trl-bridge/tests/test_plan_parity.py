"""The binary and the worker plan a run by one rule (the engine's run spec): from the same
dataset and settings they roll out the same groups in the same order, leave out the same
groups when resumed, and refuse the same empty shard with the same words.

A group's id is its place in the plan (``pass * rows + position in the shuffled pass``), so
the plan is the groups' ids, each with the row it rolled out, in the order of their ids:
the order groups are written in depends on which finishes first, the plan does not."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import take

GENERATIONS = 2
ROWS = 7
# Shard 1/3 of 7 rows holds rows 1 and 4 of each pass: 6 groups in 3 shuffled passes.
PLAN: dict[str, Any] = {"shard": "1/3", "epochs": 3, "shuffle": True, "seed": 5}
TOTAL = 6


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"Row {i}: what is {i} + 1?"} for i in range(ROWS)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def plan_of(path: Path) -> list[tuple[int, int]]:
    """The plan an output holds: each group's id with the dataset row it rolled out, in the
    order of the plan; a group written in two parts, or twice, fails."""
    groups: dict[int, int] = {}
    seen: list[int] = []
    for line in path.read_text().splitlines():
        sample = json.loads(line)
        group = sample["group_id"]
        prompt = sample["prompt"][0]["content"]
        row = int(prompt.split(":")[0].removeprefix("Row "))
        assert groups.setdefault(group, row) == row, f"group {group}: rows {groups[group]} and {row}"
        if not seen or seen[-1] != group:
            seen.append(group)
    assert len(seen) == len(groups), f"a group written in two parts or twice: {seen}"
    return sorted(groups.items())


def run_binary(
    binary: str, tokenizer_dir: str, dataset: Path, out: Path, *extra: str, shard: str = PLAN["shard"]
) -> subprocess.CompletedProcess[str]:
    """The binary on its built-in simulator, one group in flight at a time."""
    command = [
        binary, "rollout",
        "--tokenizer", tokenizer_dir,
        "--dataset", str(dataset),
        "--out", str(out),
        "--reward", "length:100",
        "--num-generations", str(GENERATIONS),
        "--max-inflight", str(GENERATIONS),
        "--max-tokens", "32",
        "--progress", "off",
        "--shard", shard,
        "--epochs", str(PLAN["epochs"]),
        "--seed", str(PLAN["seed"]),
        "--shuffle",
        *extra,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def run_worker(make_worker, sim, dataset: Path, out: Path, count: int, **extra: Any) -> None:
    """The worker over the same plan, one group in flight at a time, until `count` groups."""
    worker = make_worker(
        sim,
        dataset=str(dataset),
        output=str(out),
        num_generations=GENERATIONS,
        max_inflight_tasks=GENERATIONS,
        max_tokens=32,
        **PLAN,
        **extra,
    )
    worker.start()
    take(worker, count * GENERATIONS)
    worker.stop()


def test_the_binary_and_the_worker_roll_out_the_same_groups_in_the_same_order(
    binary, tokenizer_dir, simulator, make_worker, dataset: Path, tmp_path: Path
) -> None:
    by_binary = tmp_path / "binary.jsonl"
    done = run_binary(binary, tokenizer_dir, dataset, by_binary)
    assert done.returncode == 0, done.stderr
    by_worker = tmp_path / "worker.jsonl"
    run_worker(make_worker, simulator(), dataset, by_worker, TOTAL)

    planned = plan_of(by_binary)
    assert len(planned) == TOTAL, planned
    for epoch in range(PLAN["epochs"]):
        # A group's id is its place in the run (pass * rows + position in the shuffled pass).
        rows = sorted(row for group, row in planned if group // ROWS == epoch)
        assert rows == [1, 4], f"rows 1 and 4 of pass {epoch}: {planned}"
    assert any(group % ROWS != row for group, row in planned), f"shuffled: {planned}"
    assert plan_of(by_worker) == planned


def test_a_resumed_binary_and_a_resumed_worker_leave_out_the_same_groups(
    binary, tokenizer_dir, simulator, make_worker, dataset: Path, tmp_path: Path
) -> None:
    fresh = tmp_path / "fresh.jsonl"
    assert run_binary(binary, tokenizer_dir, dataset, fresh).returncode == 0
    planned = plan_of(fresh)

    by_binary = tmp_path / "binary.jsonl"
    first = run_binary(binary, tokenizer_dir, dataset, by_binary, "--groups", "2")
    assert first.returncode == 0, first.stderr
    assert plan_of(by_binary) == planned[:2]
    second = run_binary(binary, tokenizer_dir, dataset, by_binary, "--resume")
    assert second.returncode == 0, second.stderr
    assert plan_of(by_binary) == planned

    sim = simulator()
    by_worker = tmp_path / "worker.jsonl"
    run_worker(make_worker, sim, dataset, by_worker, 2, groups=2)
    assert plan_of(by_worker) == planned[:2]
    run_worker(make_worker, sim, dataset, by_worker, TOTAL - 2, resume=True)
    assert plan_of(by_worker) == planned


def test_the_binary_and_the_worker_refuse_a_shard_that_holds_no_row_in_the_same_words(
    binary, tokenizer_dir, simulator, make_worker, dataset: Path, tmp_path: Path
) -> None:
    words = "shard 7/9 holds no row of a dataset of 7 rows"
    out = tmp_path / "binary.jsonl"
    done = run_binary(binary, tokenizer_dir, dataset, out, shard="7/9")
    assert done.returncode != 0
    assert words in done.stderr, done.stderr
    assert not out.exists() or out.stat().st_size == 0, "nothing written"
    with pytest.raises(ValueError, match=f"shard: {words}"):
        make_worker(simulator(), dataset=str(dataset), **{**PLAN, "shard": "7/9"})


def test_the_binary_and_the_worker_refuse_a_reward_that_reads_a_column_no_row_has(
    binary, tokenizer_dir, simulator, make_worker, dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "binary.jsonl"
    done = run_binary(binary, tokenizer_dir, dataset, out, "--reward", "numeric:solution")
    assert done.returncode != 0
    assert "has a column 'solution'; its rows have: no column but the prompt" in done.stderr, done.stderr
    with pytest.raises(
        ValueError,
        match=r"reward_funcs\[0\]: no row of the dataset has a column 'solution'; its rows have: no column but the prompt",
    ):
        make_worker(simulator(), dataset=str(dataset), reward_funcs=["numeric:solution"], **PLAN)
