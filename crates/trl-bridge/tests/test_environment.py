"""Environments of OpenEnv's session-factory shape (``environment=``), driven white-box: the
engine samples, the session runs the tools, ends the episode and verifies it."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import drain_metrics, take, wait_until


# OpenEnv's result types, as its harness module defines them (dataclasses).
@dataclass
class ToolResult:
    data: Any = None
    done: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class VerifyResult:
    env_reward: float | None = None
    done: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, Any] = field(default_factory=dict)


@dataclass
class Tool:
    """An MCP tool as OpenEnv lists it."""

    name: str
    description: str
    input_schema: dict[str, Any]


CALCULATOR = Tool(
    name="calculator",
    description="Evaluates an arithmetic expression.",
    input_schema={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
)


def os_thread() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


def evaluate(expression: str) -> int:
    """Evaluates an arithmetic expression.

    Args:
        expression: Two integers and an operator, such as "3 + 4".
    """
    left, operator, right = expression.split()
    a, b = int(left), int(right)
    return {"+": a + b, "-": a - b, "*": a * b}[operator]


class Calculators:
    """A factory of calculator sessions that records everything done to them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.created: list[dict[str, Any]] = []
        self.sessions: list[CalculatorSession] = []

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> CalculatorSession:
        with self.lock:
            index = len(self.sessions)
            self.created.append({"task": task, "seed": seed, "episode_id": episode_id, "thread": os_thread()})
            session = CalculatorSession(index)
            self.sessions.append(session)
            return session


class CalculatorSession:
    def __init__(self, index: int) -> None:
        self.index = index
        self.calls: list[tuple[str, dict[str, Any], str]] = []
        self.transcripts: list[list[dict[str, Any]]] = []
        self.reward: float | None = None
        self.closed = 0

    def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": f"You are calculator number {self.index}."}]

    def list_tools(self) -> list[Tool]:
        return [CALCULATOR]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        self.calls.append((name, arguments, os_thread()))
        value = evaluate(arguments["expression"])
        return ToolResult(data={"value": value}, done=True, metadata={"reward": 1.0})

    def verify(self, transcript: list[dict[str, Any]], final_state: Any = None) -> VerifyResult:
        self.transcripts.append(transcript)
        # A reward of the session's own, so that each sample can be traced to its session.
        self.reward = float(self.index % 5)
        return VerifyResult(
            env_reward=self.reward,
            done=True,
            metrics={"session": self.index, "note": "not a number"},
            artifacts={"log": f"session {self.index}"},
        )

    def close(self) -> None:
        self.closed += 1


def test_each_rollout_runs_in_a_session_of_its_own_from_create_to_close(simulator, make_worker, tmp_path) -> None:
    sim = simulator(tool_rounds=1)
    environment = Calculators()
    output = tmp_path / "rows.jsonl"
    worker = make_worker(
        sim,
        reward_funcs=None,
        environment=environment,
        dataset=[{"prompt": "What is 6 * 7?", "answer": "42"}, {"prompt": "What is 2 + 3?", "answer": "5"}],
        output=str(output),
    )
    worker.start()
    samples = take(worker, 8)
    worker.stop()

    sessions = environment.sessions
    assert len(sessions) >= 8
    # Every session is closed exactly once, those of rollouts cut short by stop() included.
    assert [s.closed for s in sessions] == [1] * len(sessions)
    created = environment.created
    assert len({c["episode_id"] for c in created}) == len(created)
    assert all(isinstance(c["seed"], int) for c in created)
    # The task is the dataset row: its prompt as messages and its other columns.
    rows = {c["task"]["answer"]: c["task"] for c in created}
    assert rows["42"]["prompt"] == [{"role": "user", "content": "What is 6 * 7?"}]
    # Sessions are created and called on the engine's tool pool, never on Python's threads.
    threads = {c["thread"] for c in created} | {call[2] for s in sessions for call in s.calls}
    assert all(name.startswith("async-grpo-tool") for name in threads), threads

    for sample in samples:
        session = sessions[int(sample.metrics["rollout/env/session"])]
        # The session's initial messages come first, then the row's prompt.
        assert sample.prompt[0] == {"role": "system", "content": f"You are calculator number {session.index}."}
        assert sample.prompt[1]["role"] == "user"
        # The session's tool ran the model's call, and its `done` ended the episode there.
        call, result = sample.completion
        assert call["tool_calls"][0]["function"]["name"] == "calculator"
        [(name, arguments, _)] = session.calls
        assert json.loads(result["content"]) == {"value": evaluate(arguments["expression"])}
        # verify() read the whole transcript, the final tool call included, and its reward is
        # the sample's `env` column.
        assert session.transcripts == [sample.prompt + sample.completion]
        assert sample.metrics["rewards/env"] == session.reward
        assert "rollout/env/note" not in sample.metrics
        assert sample.metrics["rollout/env_verify_done"] == 1.0

    # What the session said beyond numbers is in the rows written: verify's artifacts (and
    # its metric that is not a number), each tool call's metadata.
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert rows
    for row in rows:
        index = int(row["metrics"]["env/session"])
        assert row["environment"] == {
            "artifacts": {"log": f"session {index}", "metrics": {"note": "not a number"}},
            "tools": [{"name": "calculator", "metadata": {"reward": 1.0}}],
        }
        # The call's metadata reward is the step reward of the one assistant turn that made it.
        assert row["step_rewards"] == [1.0]


class RewardInData(Calculators):
    """Sessions whose tool gives its step reward in the result's data, not its metadata."""

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> CalculatorSession:
        session = super().create(task, seed, episode_id)

        def call_tool(name: str, arguments: dict[str, Any]) -> ToolResult:
            return ToolResult(data={"value": evaluate(arguments["expression"]), "reward": 0.5}, done=True)

        session.call_tool = call_tool  # type: ignore[method-assign]
        return session


def test_a_step_reward_in_the_result_s_data_is_kept_for_its_turn(simulator, make_worker, tmp_path) -> None:
    sim = simulator(tool_rounds=1)
    output = tmp_path / "rows.jsonl"
    worker = make_worker(sim, reward_funcs=None, environment=RewardInData(), output=str(output))
    worker.start()
    take(worker, 4)
    worker.stop()
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert rows
    assert all(row.get("step_rewards") == [0.5] for row in rows), [row.get("step_rewards") for row in rows]


class AsyncCalculators:
    """The same environment with every method ``async def``."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.closed = 0
        self.created = 0

    async def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> Any:
        await asyncio.sleep(0.001)
        self.created += 1
        return AsyncCalculatorSession(self)


class AsyncCalculatorSession:
    def __init__(self, factory: AsyncCalculators) -> None:
        self.factory = factory

    async def list_tools(self) -> list[dict[str, Any]]:
        # OpenAI's function shape is accepted too.
        return [{"type": "function", "function": {"name": "calculator", "parameters": CALCULATOR.input_schema}}]

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        await asyncio.sleep(0.001)
        self.factory.threads.append(threading.current_thread().name)
        return str(evaluate(arguments["expression"]))

    async def verify(self, transcript: list[dict[str, Any]], final_state: Any = None) -> float:
        return 2.5

    async def close(self) -> None:
        self.factory.closed += 1


def test_async_sessions_are_awaited_on_the_worker_s_asyncio_loop(simulator, make_worker) -> None:
    sim = simulator(tool_rounds=1)
    environment = AsyncCalculators()
    worker = make_worker(sim, reward_funcs=[], environment=environment, environment_weight=2.0)
    worker.start()
    samples = take(worker, 4)
    worker.stop()

    assert environment.threads and set(environment.threads) == {"async-grpo-asyncio"}
    assert environment.closed == environment.created
    for sample in samples:
        call, result, answer = sample.completion  # not done: the model answers after the tool
        assert result["content"] == str(evaluate(call["tool_calls"][0]["function"]["arguments"]["expression"]))
        assert sample.metrics["rewards/env"] == 2.5
        assert sample.metrics["reward"] == 5.0  # weighted by environment_weight


class Flaky(Calculators):
    """Fails the first attempt at creating each episode's session; its tool fails on odd
    sessions; its verify fails on sessions divisible by three."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts: dict[str, int] = {}

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> CalculatorSession:
        self.attempts[episode_id] = self.attempts.get(episode_id, 0) + 1
        if self.attempts[episode_id] == 1:
            raise ConnectionError("the sandbox is still starting")
        session = super().create(task, seed, episode_id)
        if session.index % 2:
            session.call_tool = self.broken_tool  # type: ignore[method-assign]
        if session.index % 3 == 0:
            session.verify = self.broken_verify  # type: ignore[method-assign]
        return session

    @staticmethod
    def broken_tool(name: str, arguments: dict[str, Any]) -> ToolResult:
        raise RuntimeError("the calculator is broken")

    @staticmethod
    def broken_verify(transcript: list[dict[str, Any]], final_state: Any = None) -> VerifyResult:
        raise RuntimeError("cannot judge")


def test_failures_in_create_call_tool_and_verify_leave_the_run_going(simulator, make_worker) -> None:
    sim = simulator(tool_rounds=1)
    environment = Flaky()
    worker = make_worker(sim, reward_funcs=[], environment=environment)
    worker.start()
    # Which sessions finish first is the scheduler's choice: samples are taken until one of a
    # session with a broken tool (odd) and one with a broken verify (divisible by 3) are in,
    # 64 at most (all 64 missing either kind has a chance below 1e-11).
    samples = take(worker, 12)
    while len(samples) < 64 and not (
        any("the calculator is broken" in s.completion[1]["content"] for s in samples)
        and any(math.isnan(s.metrics["rewards/env"]) for s in samples)
    ):
        samples += take(worker, 4)
    worker.stop()

    # Each episode's first create failed and the second, retried, made its session.
    assert max(environment.attempts.values()) == 2
    assert sum(n == 2 for n in environment.attempts.values()) == len(environment.sessions) >= len(samples)
    assert [s.closed for s in environment.sessions] == [1] * len(environment.sessions)
    errors = [s for s in samples if "the calculator is broken" in s.completion[1]["content"]]
    assert errors, "a raising call_tool is the tool's error, which the model reads"
    assert all(s.completion[-1]["role"] == "assistant" for s in errors), "the episode goes on after the error"
    unscored = [s for s in samples if math.isnan(s.metrics["rewards/env"])]
    assert unscored, "a raising verify leaves the rollout unscorable"
    assert all(s.advantage == 0.0 for s in unscored)


@pytest.mark.parametrize(
    ("options", "error", "names"),
    [
        ({"environment": object()}, TypeError, "create("),
        ({"environment": Calculators(), "tools": [evaluate]}, ValueError, "environment"),
        ({"environment": Calculators(), "environment_weight": float("nan")}, ValueError, "environment_weight"),
        ({"reward_funcs": []}, ValueError, "environment="),
    ],
    ids=["no create", "tools too", "weight", "neither"],
)
def test_a_wrong_environment_fails_at_construction_naming_it(
    simulator, make_worker, options: dict[str, Any], error: type[Exception], names: str
) -> None:
    sim = simulator()
    with pytest.raises(error, match=names.replace("(", r"\(")):
        make_worker(sim, **options)
