"""Sync Python tools and reward functions run in worker processes by default, each with a GIL
of its own: Python burning CPU there does not stall the trainer's threads. Callables that
cannot move run in the trainer's process, with one warning each; state a tool keeps lives in
its worker process's copy; a worker process that dies is replaced; stop() leaves none."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import take


def burn(seconds: float) -> None:
    """Holds the GIL of the process it runs in for `seconds` of CPU."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1


def burner(expression: str) -> str:
    """Burns 5 ms of Python CPU and says which process it ran in.

    Args:
        expression: The expression.
    """
    burn(0.005)
    return json.dumps({"pid": os.getpid(), "expression": expression})


def burning_reward(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    burn(0.02)
    return [float(os.getpid() != columns["trainer_pid"][0]) for _ in completions]


class Counter:
    """A tool that keeps state between calls: the calls it has seen."""

    name = "counter"

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.calls = state["calls"]
        self.lock = threading.Lock()

    def __call__(self, expression: str) -> str:
        """Counts.

        Args:
            expression: The expression.
        """
        with self.lock:
            self.calls += 1
            return json.dumps({"pid": os.getpid(), "calls": self.calls})


def tagged(expression: str, tag: str) -> str:
    """Tags an expression.

    Args:
        expression: The expression.
        tag: The tag.
    """
    return json.dumps({"pid": os.getpid(), "tag": tag})


def fragile(expression: str) -> str:
    """Kills the process it runs in on 1 + 1.

    Args:
        expression: The expression.
    """
    if expression == "1 + 1":
        os._exit(7)
    return json.dumps({"pid": os.getpid()})


def tool_answers(samples: list[Any]) -> list[str]:
    return [m["content"] for s in samples for m in s.completion if m["role"] == "tool"]


class Ticker:
    """A thread of the trainer's process that wants to wake every 10 ms: how late it woke."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="ticker", daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            before = time.perf_counter()
            time.sleep(0.01)
            self.lags.append(time.perf_counter() - before - 0.01)

    def p99(self) -> float:
        lags = sorted(self.lags)
        return lags[int(0.99 * (len(lags) - 1))]


def test_a_cpu_burning_tool_and_reward_leave_the_trainers_threads_responsive(simulator, make_worker) -> None:
    sim = simulator(tool_rounds=2, tool_name="burner")
    worker = make_worker(
        sim,
        tools=[burner],
        reward_funcs=[burning_reward],
        dataset=[{"prompt": f"What is {a} + 3?", "trainer_pid": os.getpid()} for a in range(8)],
        max_inflight_tasks=32,
    )
    worker.start()
    take(worker, 4)  # the worker processes are up
    ticker = Ticker()
    ticker.thread.start()
    samples: list[Any] = []
    started = time.monotonic()
    try:
        # At least 64 samples and 2 s of ticks, however fast the samples come.
        while len(samples) < 64 or time.monotonic() - started < 2.0:
            samples += take(worker, 8, within=120.0)
    finally:
        ticker.stop.set()
        ticker.thread.join()
    pids = {json.loads(answer)["pid"] for answer in tool_answers(samples)}
    assert pids and os.getpid() not in pids, "the sync tool ran in worker processes"
    assert all(s.metrics["rewards/burning_reward"] == 1.0 for s in samples), "the reward ran in a worker process"
    assert ticker.p99() < 0.050, (
        f"a trainer thread woke {1e3 * ticker.p99():.1f} ms late (p99 of {len(ticker.lags)}) while tools "
        "and rewards burned CPU"
    )


def test_sync_callables_of_every_picklable_shape_run_in_worker_processes(simulator, make_worker) -> None:
    tools: list[Any] = [
        Counter(),
        {"function": functools.partial(tagged, tag="partial"), "name": "partial_tool"},
    ]
    for tool in tools:
        name = tool["name"] if isinstance(tool, dict) else tool.name
        sim = simulator(tool_rounds=1, tool_name=name)
        worker = make_worker(sim, tools=[tool], dataset=[{"prompt": "What is 6 * 7?"}], num_generations=2, epochs=1)
        worker.start()
        answers = tool_answers(take(worker, 2))
        worker.stop()
        assert answers and all(json.loads(a)["pid"] != os.getpid() for a in answers), (name, answers)


def test_state_a_tool_keeps_lives_in_its_worker_process(simulator, make_worker) -> None:
    counter = Counter()
    sim = simulator(tool_rounds=3, tool_name="counter")
    worker = make_worker(
        sim,
        tools=[counter],
        dataset=[{"prompt": "What is 6 * 7?"}],
        num_generations=4,
        epochs=1,
        python_processes=1,
    )
    worker.start()
    answers = [json.loads(a) for a in tool_answers(take(worker, 4))]
    worker.stop()
    # One worker process ran all 12 calls on its own copy, which counted every one of them...
    assert len({a["pid"] for a in answers}) == 1
    assert sorted(a["calls"] for a in answers) == list(range(1, 13))
    # ...and the trainer's object never changed.
    assert counter.calls == 0


def test_a_tool_that_cannot_be_pickled_runs_here_with_one_warning(simulator, make_worker, caplog) -> None:
    def closure(expression: str) -> str:
        """A local function: it cannot be pickled.

        Args:
            expression: The expression.
        """
        burn(0.001)
        return json.dumps({"pid": os.getpid()})

    sim = simulator(tool_rounds=2, tool_name="closure")
    with caplog.at_level(logging.WARNING, logger="async_grpo"):
        worker = make_worker(sim, tools=[closure], dataset=[{"prompt": "What is 6 * 7?"}], num_generations=2)
        worker.start()
        answers = tool_answers(take(worker, 6))
    assert answers and all(json.loads(a)["pid"] == os.getpid() for a in answers)
    warnings = [r.getMessage() for r in caplog.records if "closure" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "cannot be pickled" in warnings[0] and "GIL" in warnings[0], warnings[0]


def test_a_worker_process_that_dies_fails_its_call_and_is_replaced(simulator, make_worker) -> None:
    sim = simulator(tool_rounds=1, tool_name="fragile")
    worker = make_worker(
        sim,
        tools=[fragile],
        dataset=[{"prompt": "What is 1 + 1?"}, {"prompt": "What is 2 + 2?"}],
        num_generations=2,
        # One rollout at a time: 1 + 1, 1 + 1, 2 + 2, 2 + 2, 1 + 1, ...
        max_inflight_tasks=1,
        python_processes=1,
    )
    worker.start()
    samples = take(worker, 12)
    answers = tool_answers(samples)
    died = [a for a in answers if "exited" in a]
    lived = [json.loads(a)["pid"] for a in answers if a.startswith("{\"pid\"")]
    assert died and all("exit status: 7" in a for a in died), died
    assert len(set(lived)) > 1, "the 2 + 2 calls ran in new worker processes after each death"
    worker.check_health(60.0)


def test_stop_leaves_no_worker_process(simulator, make_worker) -> None:
    sim = simulator(tool_rounds=1, tool_name="burner")
    worker = make_worker(sim, tools=[burner], python_processes=2)
    worker.start()
    pids = {json.loads(a)["pid"] for a in tool_answers(take(worker, 8))}
    assert pids
    worker.stop()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"worker process {pid} is left after stop()"


SCRIPT = """
import json, os, sys, time
import async_grpo

def burner(expression: str) -> str:
    '''Burns CPU in the script's own module.

    Args:
        expression: The expression.
    '''
    return json.dumps({"pid": os.getpid()})

def reward(prompts, completions, **columns):
    return [1.0 for _ in completions]

if __name__ == "__main__":
    sim = async_grpo.Simulator(sys.argv[1], tool_rounds=1, tool_name="burner")
    worker = async_grpo.RolloutWorker(
        model_name="sim", dataset=[{"prompt": "What is 6 * 7?"}], reward_funcs=[reward], tools=[burner],
        processing_class=sys.argv[1], vllm_server_url=sim.url, num_generations=2, epochs=1, server_wait=30.0)
    worker.start()
    samples = [worker.rollout_buffer.get(timeout=60) for _ in range(2)]
    worker.stop()
    sim.stop()
    print(json.dumps({"trainer": os.getpid(),
                      "tools": [json.loads(m["content"])["pid"] for s in samples for m in s.completion
                                if m["role"] == "tool"]}))
"""


def test_callables_of_the_script_being_run_move_as_spawn_moves_them(tokenizer_dir: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    run = subprocess.run(
        [sys.executable, str(script), tokenizer_dir], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["tools"] and result["trainer"] not in result["tools"], result
    assert "runs in the trainer's process" not in run.stderr


def test_a_callable_of_an_interactive_session_stays_here_and_says_why(tokenizer_dir: str) -> None:
    code = textwrap.dedent(
        f"""
        import logging, async_grpo
        logging.basicConfig(level=logging.WARNING)
        def tool(expression: str) -> str:
            '''A tool of `python -c`.

            Args:
                expression: The expression.
            '''
            return expression
        async_grpo.RolloutWorker(model_name="sim", dataset=[{{"prompt": "hi"}}], reward_funcs=[lambda **k: []],
                                 tools=[tool], processing_class={tokenizer_dir!r})
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "tool 'tool' runs in the trainer's process" in run.stderr, run.stderr
    assert "interactive session" in run.stderr, run.stderr


@pytest.mark.parametrize("value", [-1, 1.5, "2"])
def test_python_processes_must_be_a_count(simulator, make_worker, value: Any) -> None:
    sim = simulator()
    with pytest.raises((TypeError, ValueError), match="python_processes"):
        make_worker(sim, python_processes=value)


def test_python_processes_zero_keeps_every_callable_here(simulator, make_worker) -> None:
    sim = simulator(tool_rounds=1, tool_name="burner")
    worker = make_worker(sim, tools=[burner], python_processes=0, dataset=[{"prompt": "What is 6 * 7?"}], epochs=1)
    worker.start()
    answers = tool_answers(take(worker, 4))
    assert answers and all(json.loads(a)["pid"] == os.getpid() for a in answers)


def nice_of(stat: Path) -> int:
    """The nice value in a /proc stat file (its 19th field, after the command in parentheses)."""
    return int(stat.read_text().rsplit(")", 1)[1].split()[16])


@pytest.mark.parametrize("nice", [10, 0])
def test_the_engines_threads_and_worker_processes_yield_the_cpu_to_the_trainers(
    simulator, make_worker, nice: int
) -> None:
    sim = simulator(tool_rounds=1, tool_name="burner")
    worker = make_worker(sim, tools=[burner], nice=nice)
    worker.start()
    pids = {json.loads(a)["pid"] for a in tool_answers(take(worker, 8))}
    mine = nice_of(Path(f"/proc/self/task/{threading.get_native_id()}/stat"))
    engine = {}
    for task in Path("/proc/self/task").iterdir():
        name = (task / "comm").read_text().strip()
        if name.startswith(("async-grpo-rt", "async-grpo-tool", "async-grpo-reward", "async-grpo-pool")):
            engine[f"{name}/{task.name}"] = nice_of(task / "stat")
    assert any(n.startswith("async-grpo-rt") for n in engine) and any(n.startswith("async-grpo-tool") for n in engine)
    expected = min(mine + nice, 19)
    assert set(engine.values()) == {expected}, engine
    assert {nice_of(Path(f"/proc/{pid}/stat")) for pid in pids} == {expected}
    assert nice_of(Path(f"/proc/self/task/{threading.get_native_id()}/stat")) == mine, "the trainer's own is kept"


def test_nice_must_be_0_to_19(simulator, make_worker) -> None:
    sim = simulator()
    for value in (-1, 20):
        with pytest.raises(ValueError, match="nice"):
            make_worker(sim, nice=value)


def test_a_worker_process_imports_neither_the_worker_nor_trl() -> None:
    """What a worker process imports (``async_grpo._pool``) leaves out ``RolloutWorker`` and
    the lookup of TRL's ``RolloutSample``, which may import TRL and torch (a second and a
    gigabyte each, in a TRL venv)."""
    code = "import sys, async_grpo._pool; print(sorted(m for m in sys.modules if m.startswith(('async_grpo', 'trl'))))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    loaded = run.stdout
    assert "async_grpo._pool" in loaded
    assert "async_grpo._worker" not in loaded and "async_grpo._sample" not in loaded, loaded
