"""A Python tool blocking in time.sleep stalls neither the engine's heartbeat nor the other
rollouts: sync tools run on the tool pool, whose threads hold the GIL only while Python runs.
(Run the tool on the engine's runtime threads instead and this test fails: both runtime
threads sleep, so no other rollout moves and the heartbeat stops.)"""

from __future__ import annotations

import threading
import time

from conftest import take, wait_until


def test_a_tool_blocking_in_sleep_stalls_neither_the_heartbeat_nor_other_rollouts(simulator, make_worker) -> None:
    release = threading.Event()
    lock = threading.Lock()
    blocked: list[str] = []

    def slow(expression: str) -> str:
        """Blocks the first two calls on 1 + 1.

        Args:
            expression: The expression.
        """
        with lock:
            block = expression == "1 + 1" and len(blocked) < 2
            if block:
                blocked.append(expression)
        if block:
            deadline = time.monotonic() + 30.0
            while not release.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)  # blocking, as a sandbox or an HTTP call would
        return expression

    sim = simulator(tool_rounds=1, tool_name="slow", latency="5ms")
    worker = make_worker(
        sim,
        tools=[slow],
        # Two rollouts of the first row block; the other rows keep the engine busy.
        dataset=[{"prompt": "What is 1 + 1?"}] + [{"prompt": f"What is {a} * 3?"} for a in range(2, 8)],
        num_generations=2,
        max_inflight_tasks=8,
        runtime_threads=2,
        tool_timeout=60.0,
    )
    try:
        worker.start()
        wait_until(lambda: len(blocked) == 2, 20.0, "two calls blocked in the tool")
        # While both calls block (as many as the runtime has threads), other rollouts finish...
        others = take(worker, 12, within=20.0)
        assert len(blocked) == 2 and not release.is_set()
        assert all(s.group_id != 0 for s in others), "group 0 (the blocked rollouts) cannot be done yet"
        # ...and the heartbeat keeps beating: its age drops each time it beats.
        beats, last = 0, worker.stats()["heartbeat_age_s"]
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            time.sleep(0.02)
            age = worker.stats()["heartbeat_age_s"]
            beats += age < last
            last = age
        assert beats > 2, f"the heartbeat beat {beats} times in a second while tools blocked"
        worker.check_health(2.0)
    finally:
        release.set()
    wait_until(
        lambda: any(s.group_id == 0 for s in take(worker, 1)), 30.0, "the blocked rollouts to finish once released"
    )


def test_python_tool_threads_bounds_the_sync_tools_running_python_at_once(simulator, make_worker) -> None:
    lock = threading.Lock()
    running, most = [0], [0]

    def busy(expression: str) -> str:
        """Holds its thread a little.

        Args:
            expression: The expression.
        """
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return expression

    for bound, expect_most in ((None, lambda m: m > 1), (1, lambda m: m == 1)):
        most[0] = 0
        sim = simulator(tool_rounds=2, tool_name="busy")
        worker = make_worker(sim, tools=[busy], max_inflight_tasks=16, python_tool_threads=bound)
        worker.start()
        take(worker, 24)
        worker.stop()
        assert expect_most(most[0]), f"python_tool_threads={bound}: {most[0]} calls ran Python at once"
