"""Fixtures of the bridge's suite: the real Qwen3 tokenizer from the fixtures cache, the
simulator as the model, workers that are always stopped, bounded waits."""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import async_grpo


def cache_dir() -> Path:
    """Where `cargo xtask fixtures` puts the real tokenizers (as xtask finds it)."""
    if os.environ.get("ASYNC_GRPO_CACHE"):
        return Path(os.environ["ASYNC_GRPO_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "async-grpo"


@pytest.fixture(scope="session")
def binary() -> str:
    """The `async-grpo` binary (`cargo xtask pytest` builds it and names it here)."""
    path = os.environ.get("ASYNC_GRPO_BIN", "")
    assert path and Path(path).is_file(), (
        f"ASYNC_GRPO_BIN is {path!r}: run the suite with `cargo xtask pytest`, which builds the binary"
    )
    return path


@pytest.fixture(scope="session")
def tokenizer_dir() -> str:
    path = cache_dir() / "qwen3"
    assert (path / "tokenizer.json").is_file(), f"{path} has no tokenizer.json: run `cargo xtask fixtures`"
    return str(path)


@pytest.fixture
def simulator(tokenizer_dir: str) -> Iterator[Callable[..., async_grpo.Simulator]]:
    """Starts simulators answering in the Qwen3 tokenizer; stops them after the test."""
    started: list[async_grpo.Simulator] = []

    def start(**options: Any) -> async_grpo.Simulator:
        sim = async_grpo.Simulator(tokenizer_dir, **options)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.stop()


def default_reward(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
    return [float(len(c[-1]["content"]) % 3) for c in completions]


@pytest.fixture
def make_worker(tokenizer_dir: str) -> Iterator[Callable[..., async_grpo.RolloutWorker]]:
    """Builds workers with the suite's defaults; stops every one after the test."""
    made: list[async_grpo.RolloutWorker] = []

    def make(sim: async_grpo.Simulator, **options: Any) -> async_grpo.RolloutWorker:
        arguments: dict[str, Any] = {
            "model_name": "sim",
            "dataset": [{"prompt": f"What is {a} + {a + 1}?", "answer": str(2 * a + 1)} for a in range(1, 9)],
            "reward_funcs": [default_reward],
            "processing_class": tokenizer_dir,
            "vllm_server_url": sim.url,
            "num_generations": 4,
            "max_tokens": 64,
            "server_wait": 30.0,
        }
        arguments.update(options)
        worker = async_grpo.RolloutWorker(**arguments)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.stop()


def take(worker: async_grpo.RolloutWorker, count: int, within: float = 30.0) -> list[Any]:
    """`count` samples from the worker's buffer, failing (not hanging) after `within` seconds."""
    samples: list[Any] = []
    deadline = time.monotonic() + within
    while len(samples) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            worker.check_health(3600.0)
            pytest.fail(f"only {len(samples)} of {count} samples arrived within {within}s; stats {worker.stats()}")
        try:
            samples.append(worker.rollout_buffer.get(timeout=min(left, 0.5)))
        except queue.Empty:
            continue
    return samples


def wait_until(condition: Callable[[], bool], within: float, what: str) -> None:
    """Polls `condition` until it holds, failing with `what` after `within` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within}s")
        time.sleep(0.02)


def drain_metrics(worker: async_grpo.RolloutWorker) -> list[dict[str, Any]]:
    items = []
    while True:
        try:
            items.append(worker.metrics_queue.get_nowait())
        except queue.Empty:
            return items


def os_thread_names() -> list[str]:
    """The names of this process's OS threads (Rust threads included)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            continue
    return sorted(names)


def turns_of(sample: Any, transcript: list[tuple[list[int], list[int], list[float], str]]) -> list[tuple]:
    """The simulator's answers that make up `sample`: each turn's prompt and answer are a
    prefix of the sample's ids, and the answer's logprobs are the sample's there (sibling
    rollouts share scripted ids, never seeded logprobs)."""
    # Imported here: worker processes unpickle the suite's reward functions from this module,
    # and numpy would slow their start.
    import numpy as np

    ids = sample.input_ids.tolist()
    found = []
    for turn in transcript:
        prompt, answer, logprobs = turn[0], turn[1], np.asarray(turn[2], np.float32)
        end = len(prompt) + len(answer)
        if end <= len(ids) and ids[:end] == prompt + answer:
            if np.array_equal(sample.old_log_probs[len(prompt) : end], logprobs):
                found.append(turn)
    return found


class RecordingQueue(queue.Queue):
    """The worker's rollout buffer, remembering what went in and what the trainer took out."""

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize)
        self.put_samples: list[Any] = []
        self.taken: list[Any] = []

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        self.put_samples.append(item)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout)
        self.taken.append(item)
        return item
