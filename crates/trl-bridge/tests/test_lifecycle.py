"""start, stop, staleness, health and threads: the worker's life as TRL's trainer drives it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import drain_metrics, os_thread_names, take, wait_until


def gate(release: threading.Event, entered: list[str]):
    def gated(expression: str) -> str:
        """Waits to be released.

        Args:
            expression: The expression.
        """
        entered.append(expression)
        release.wait(10.0)
        return expression

    return gated


def test_groups_left_stale_by_a_new_version_are_cancelled(simulator, make_worker) -> None:
    release, entered = threading.Event(), []
    sim = simulator(tool_rounds=1, tool_name="gated")
    worker = make_worker(sim, tools=[gate(release, entered)], max_staleness=1, max_inflight_tasks=8)
    try:
        worker.start()
        wait_until(lambda: len(entered) >= 8, 20.0, "every rollout in flight inside the tool")
        assert worker.rollout_buffer.empty()
        worker.update_model_version(5)
        assert worker.model_version == 5
    finally:
        release.set()
    samples = take(worker, 8)
    assert all(worker.model_version - s.model_version <= 1 for s in samples), [s.model_version for s in samples]
    stats = worker.stats()
    assert stats["groups_stale"] >= 2 and stats["model_version"] == 5.0
    wait_until(lambda: not worker.metrics_queue.empty(), 10.0, "metrics")
    assert sum(m.get("rollout/stale_groups_total", 0.0) for m in drain_metrics(worker)) >= 2.0


def test_stop_with_rollouts_in_flight_drains_cancels_and_joins_every_thread(simulator, make_worker) -> None:
    sim = simulator(tool_rounds=1, tool_name="gated")
    release, entered = threading.Event(), []
    before = os_thread_names()
    python_before = {t.name for t in threading.enumerate()}
    worker = make_worker(sim, tools=[gate(release, entered)], max_inflight_tasks=8, drain_timeout=0.5)
    worker.start()
    wait_until(lambda: len(entered) >= 8, 20.0, "every rollout in flight inside the tool")
    assert any(name.startswith("async-grpo") for name in set(os_thread_names()) - set(before))
    started = time.monotonic()
    worker.stop()
    assert time.monotonic() - started < 15.0, "stop() is bounded by the drain deadline"
    assert worker.report["clean"] is False
    assert worker.report["cancelled_at_deadline"] == 8
    worker.stop()  # idempotent
    release.set()  # the tool threads still sleeping in Python can now end
    # None left behind. (A thread of an earlier test that ends meanwhile is no leak of this one.)
    assert {t.name for t in threading.enumerate()} - python_before == set()
    wait_until(lambda: os_thread_names() == before, 20.0, f"the engine's threads to exit (left: {os_thread_names()})")


def test_no_thread_is_left_after_a_normal_stop(simulator, make_worker) -> None:
    sim = simulator(tool_rounds=1)

    def calculator(expression: str) -> str:
        """Echoes.

        Args:
            expression: The expression.
        """
        return expression

    async def judge(prompts, completions, **columns):
        return [1.0 for _ in completions]

    before = os_thread_names()
    worker = make_worker(sim, tools=[calculator], reward_funcs=[judge])
    worker.start()
    take(worker, 8)
    worker.stop()
    assert worker.report["clean"] is True and worker.report["tool_threads_left_running"] == 0
    assert not [t.name for t in threading.enumerate() if t.name.startswith("async-grpo")]
    wait_until(lambda: os_thread_names() == before, 20.0, f"the engine's threads to exit (left: {os_thread_names()})")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_check_health_raises_the_engine_s_cause_after_a_failure(simulator, make_worker) -> None:
    sim = simulator()
    worker = make_worker(sim, vllm_server_url=f"http://127.0.0.1:{closed_port()}", server_wait=0.5)
    worker.start()
    worker.check_health(60.0)  # still waiting: healthy
    wait_until(lambda: worker._engine.error() is not None, 20.0, "the engine to give up on the server")
    with pytest.raises(RuntimeError, match="servers are not ready"):
        worker.check_health(60.0)


def test_check_health_raises_when_nothing_answers_for_too_long(simulator, make_worker) -> None:
    sim = simulator()
    worker = make_worker(sim, vllm_server_url=f"http://127.0.0.1:{closed_port()}", server_wait=60.0)
    worker.start()
    waiting_since = time.monotonic()  # the worker has waited for the servers since before this
    worker.check_health(60.0)  # within its bound: healthy
    # No guessed sleep: just past the bound, as the worker counts it. Nothing answers on a
    # closed port, and the engine gives up only after server_wait (60 s).
    while time.monotonic() - waiting_since <= 0.2:
        time.sleep(0.01)
    assert worker._engine.error() is None and not worker._engine.running()
    with pytest.raises(RuntimeError, match="still waiting for the vLLM servers"):
        worker.check_health(0.2)


SCRIPT = """
import logging, os, sys, time, async_grpo
logging.basicConfig(level=logging.INFO)
tokenizer = sys.argv[1]
sim = async_grpo.Simulator(tokenizer)
worker = async_grpo.RolloutWorker(
    model_name="sim", dataset=[{"prompt": "What is 2 + 3?"}], processing_class=tokenizer,
    reward_funcs=[lambda prompts, completions, **kw: [1.0] * len(completions)],
    vllm_server_url=sim.url, num_generations=2, max_tokens=16)
worker.start()
worker.rollout_buffer.get(timeout=30)
print("got a sample", flush=True)
if sys.argv[2] == "interrupt":
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize("ending", ["exit", "interrupt"])
def test_the_worker_stops_at_interpreter_exit_and_on_keyboard_interrupt(tokenizer_dir, tmp_path: Path, ending) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script), tokenizer_dir, ending],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert "got a sample" in done.stdout, done.stderr
    assert "RolloutWorker stopped" in done.stderr, done.stderr
    if ending == "interrupt":
        # An uncaught KeyboardInterrupt ends CPython by SIGINT, after the atexit hooks ran.
        assert done.returncode == -signal.SIGINT and "KeyboardInterrupt" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
