"""The example examples/trl-opencode/train.py as CI runs it: TRL's real ``AsyncGRPOTrainer``,
three optimizer steps of a tiny random-weight Qwen3 on CPU, trained from
``async_grpo.RolloutWorker``'s rollouts of the example's Python agent against the simulator,
each judged by the example's session (the task's test on what the agent wrote, under bwrap).
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from trl.experimental.async_grpo.async_rollout_worker import RolloutSample as TrlSample

import async_grpo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import RecordingQueue, os_thread_names, wait_until  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "trl-opencode" / "train.py"


def load_example() -> ModuleType:
    """examples/trl-opencode/train.py, imported by its path."""
    spec = importlib.util.spec_from_file_location("trl_opencode_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def async_grpo_threads() -> list[str]:
    """The engine's and the simulator's threads still alive in this process."""
    python = [t.name for t in threading.enumerate() if t.name.startswith("async-grpo")]
    return python + [name for name in os_thread_names() if name.startswith("async-grpo")]


def test_the_example_trains_from_the_python_agent_s_rollouts(tmp_path: Path, monkeypatch: Any) -> None:
    example = load_example()

    # The example's worker, its buffer (as bounded) recording; the example's sessions, their
    # verify calls.
    workers: list[async_grpo.RolloutWorker] = []

    class RecordingWorker(async_grpo.RolloutWorker):
        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            self.rollout_buffer = RecordingQueue(self.rollout_buffer.maxsize)
            workers.append(self)

    verified: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
    lock = threading.Lock()
    verify = example.SolutionTest.verify

    def recording_verify(self: Any, transcript: list[dict[str, Any]], final_state: Any = None) -> dict[str, Any]:
        result = verify(self, transcript, final_state)
        with lock:
            verified.append((transcript, result))
        return result

    monkeypatch.setattr(example, "RolloutWorker", RecordingWorker)
    monkeypatch.setattr(example.SolutionTest, "verify", recording_verify)

    trainer = example.train(agent="python", max_steps=3, output_dir=tmp_path / "out")

    assert trainer.state.global_step == 3
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(math.isfinite(loss) for loss in losses), losses
    (worker,) = workers
    buffer = worker.rollout_buffer
    # Every sample the trainer consumed came from the worker, as TRL's own RolloutSample.
    assert buffer.taken, "the trainer consumed nothing"
    put = {id(s) for s in buffer.put_samples}
    assert all(id(s) in put for s in buffer.taken)
    assert all(isinstance(s, TrlSample) for s in buffer.taken)

    # verify read each agent's whole transcript, the simulator's write call to solution.py in it.
    assert verified, "no session verified"
    for transcript, _result in verified:
        calls = [c for m in transcript if m["role"] == "assistant" for c in m.get("tool_calls") or []]
        assert [c["function"]["name"] for c in calls] == ["write"]
        assert example.written_solution(transcript) is not None
    answers = {row["prompt"]: int(row["answer"]) for row in example.tasks()}
    for sample in buffer.put_samples:
        # The agent's prompt, then its transcript: the write call, its result, the answer.
        assert [m["role"] for m in sample.prompt] == ["system", "user"]
        assert [m["role"] for m in sample.completion] == ["assistant", "tool", "assistant"]
        results = [r for t, r in verified if t == sample.prompt + sample.completion]
        assert results, "verify judged this rollout's transcript"
        # Its reward is verify's (the `env` column), and the test ran: 1.0 exactly when the
        # solution written returns the task's answer.
        solution = example.written_solution(sample.prompt + sample.completion)
        returned = int(re.fullmatch(r"def solve\(\):\n    return (-?\d+)\n", solution).group(1))
        expected = 1.0 if returned == answers[sample.prompt[1]["content"]] else 0.0
        assert sample.metrics["rewards/env"] == expected
        assert all(r["env_reward"] == expected for r in results)
        assert sample.metrics["rollout/env/wrote_solution"] == 1.0
    # The simulator writes the right value half of the time: both rewards were seen.
    assert {s.metrics["rewards/env"] for s in buffer.put_samples} == {0.0, 1.0}
    assert worker.report["error"] is None

    # The worker and the simulator stopped: none of their threads is left.
    wait_until(lambda: not async_grpo_threads(), 20.0, f"the threads to exit ({async_grpo_threads()})")
