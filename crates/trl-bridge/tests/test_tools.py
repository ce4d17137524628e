"""Python tools of every shape: names, schemas, where they run, and what their failures become."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from async_grpo._callables import returns_awaitable, tool_entry
from conftest import drain_metrics, take, wait_until

CALLS: list[tuple[str, str, str]] = []  # (tag, Python thread name, OS thread name)


def where() -> tuple[str, str]:
    os_name = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
    return threading.current_thread().name, os_name


def record(tag: str, expression: str) -> str:
    assert threading.current_thread() is not threading.main_thread()
    CALLS.append((tag, *where()))
    return f"{tag}:{expression}"


def sync_function(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: Two integers and an operator, such as "3 + 4".
    """
    return record("sync_function", expression)


async def async_function(expression: str) -> str:
    """Evaluates an arithmetic expression, asynchronously.

    Args:
        expression: Two integers and an operator.
    """
    await asyncio.sleep(0.01)
    return record("async_function", expression)


class SyncObject:
    """A callable object with a name attribute."""

    name = "sync_object"

    def __call__(self, expression: str) -> str:
        """Evaluates.

        Args:
            expression: The expression.
        """
        return record("sync_object", expression)


class AsyncObject:
    """A callable object whose __call__ is async: async by what calling it returns."""

    name = "async_object"

    async def __call__(self, expression: str) -> str:
        """Evaluates.

        Args:
            expression: The expression.
        """
        await asyncio.sleep(0.01)
        return record("async_object", expression)


class Environment:
    def lookup(self, expression: str) -> str:
        """Looks the expression up.

        Args:
            expression: The expression.
        """
        return record("lookup", expression)

    async def alookup(self, expression: str) -> str:
        """Looks the expression up, asynchronously.

        Args:
            expression: The expression.
        """
        return record("alookup", expression)


def tagged(expression: str, tag: str) -> str:
    """Tags an expression.

    Args:
        expression: The expression.
        tag: The tag.
    """
    return record(tag, expression)


environment = Environment()
SHAPES: list[tuple[str, Any, bool]] = [
    ("sync_function", sync_function, False),
    ("async_function", async_function, True),
    ("sync_object", SyncObject(), False),
    ("async_object", AsyncObject(), True),
    ("lookup", environment.lookup, False),
    ("alookup", environment.alookup, True),
    ("partial_tool", {"function": functools.partial(tagged, tag="partial_tool"), "name": "partial_tool"}, False),
]


@pytest.mark.parametrize(("name", "tool", "is_async"), SHAPES, ids=[s[0] for s in SHAPES])
def test_every_tool_shape_runs_where_it_should(simulator, make_worker, name: str, tool: Any, is_async: bool) -> None:
    """In the trainer's process (python_processes=0), which CALLS sees; test_processes.py
    has the default, where sync tools run in worker processes."""
    CALLS.clear()
    sim = simulator(tool_rounds=1, tool_name=name)
    worker = make_worker(
        sim, tools=[tool], dataset=[{"prompt": "What is 6 * 7?"}], num_generations=2, epochs=1, python_processes=0
    )
    [entry] = worker.tools
    assert (entry.name, entry.is_async) == (name, is_async)
    worker.start()
    samples = take(worker, 2)
    for sample in samples:
        assert sample.completion[1]["content"] == f"{name}:6 * 7", sample.completion
    assert [c[0] for c in CALLS] == [name, name]
    for _tag, python_thread, os_thread in CALLS:
        if is_async:
            assert python_thread == "async-grpo-asyncio", "async tools run on the worker's asyncio loop"
        else:
            assert os_thread.startswith("async-grpo-tool"), "sync tools run on the engine's tool pool"


def test_whether_a_tool_is_async_is_read_from_what_calling_it_returns() -> None:
    assert [returns_awaitable(tool_entry(t, 0).function) for _, t, _ in SHAPES] == [s[2] for s in SHAPES]
    assert returns_awaitable(functools.partial(async_function))
    assert not returns_awaitable(print)


def test_schemas_are_derived_as_trl_renders_them_or_taken_as_given() -> None:
    entry = tool_entry(sync_function, 0)
    assert (entry.name, entry.description) == ("sync_function", "Evaluates an arithmetic expression.")
    assert entry.parameters == {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": 'Two integers and an operator, such as "3 + 4".'}},
        "required": ["expression"],
    }
    partial = tool_entry({"function": functools.partial(tagged, tag="x"), "name": "partial_tool"}, 0)
    assert list(partial.parameters["properties"]) == ["expression"]
    assert partial.parameters["required"] == ["expression"]
    assert tool_entry(SyncObject(), 0).parameters["properties"] == {
        "expression": {"type": "string", "description": "The expression."}
    }
    # Each builder against transformers' get_json_schema, on tools of every kind: test_schemas.py.
    explicit = {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Adds.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        },
    }
    given = tool_entry({"function": lambda a: a, "schema": explicit}, 0)
    assert (given.name, given.description, given.parameters) == ("calc", "Adds.", explicit["function"]["parameters"])


def error_of(sample: Any) -> str:
    content = sample.completion[1]["content"]
    assert content.startswith('{"error":'), f"the tool message is not an error: {content!r}"
    return str(json.loads(content)["error"])


def test_a_raising_tool_becomes_its_error_message_and_the_run_goes_on(simulator, make_worker, caplog) -> None:
    def broken(expression: str) -> str:
        """Fails.

        Args:
            expression: The expression.
        """
        raise ValueError(f"cannot evaluate {expression}")

    sim = simulator(tool_rounds=1, tool_name="broken")
    worker = make_worker(sim, tools=[broken], dataset=[{"prompt": "What is 6 * 7?"}], num_generations=2)
    with caplog.at_level(logging.WARNING, logger="async_grpo"):
        worker.start()
        samples = take(worker, 6)
    assert all("ValueError: cannot evaluate 6 * 7" in error_of(s) for s in samples)
    assert all(s.metrics["rollout/tool_errors"] == 1.0 for s in samples)
    records = [r for r in caplog.records if "broken raised" in r.getMessage()]
    assert records and records[0].exc_info is not None, "the traceback is logged"
    wait_until(lambda: not worker.metrics_queue.empty(), 10.0, "metrics")
    assert sum(m.get("tools/failure_total", 0.0) for m in drain_metrics(worker)) >= 2.0
    worker.check_health(60.0)


def test_hanging_tools_hit_the_timeout_and_async_ones_are_cancelled(simulator, make_worker) -> None:
    release = threading.Event()
    cancelled = threading.Event()

    def stuck(expression: str) -> str:
        """Hangs.

        Args:
            expression: The expression.
        """
        release.wait(20.0)
        return "late"

    async def astuck(expression: str) -> str:
        """Hangs, asynchronously.

        Args:
            expression: The expression.
        """
        try:
            await asyncio.sleep(60.0)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    try:
        for name, tool in (("stuck", stuck), ("astuck", astuck)):
            sim = simulator(tool_rounds=1, tool_name=name)
            worker = make_worker(
                sim, tools=[tool], dataset=[{"prompt": "What is 6 * 7?"}], num_generations=2, tool_timeout=0.3
            )
            worker.start()
            samples = take(worker, 2)
            assert all("timed out" in error_of(s) for s in samples), [s.completion[1] for s in samples]
            worker.check_health(60.0)
        wait_until(cancelled.is_set, 10.0, "the timed-out async tool to be cancelled on the loop")
    finally:
        release.set()


def test_a_sync_tool_that_returns_an_awaitable_is_an_error_naming_it(simulator, make_worker) -> None:
    def sneaky(expression: str) -> Any:
        """Looks sync, returns a coroutine.

        Args:
            expression: The expression.
        """
        return asyncio.sleep(0)

    sim = simulator(tool_rounds=1, tool_name="sneaky")
    worker = make_worker(sim, tools=[sneaky], dataset=[{"prompt": "What is 6 * 7?"}], num_generations=2)
    assert not worker.tools[0].is_async
    worker.start()
    [sample, *_] = take(worker, 2)
    assert "'sneaky'" in error_of(sample) and "async def" in error_of(sample)


def test_a_session_backed_python_tool_keeps_each_rollouts_state_without_a_sandbox_of_ours(
    simulator, make_worker
) -> None:
    """A table among tools= is the binary's [[tools]]: one sandboxed interpreter per rollout."""
    code = "n = globals().get('n', 0) + 1\nimport os\nprint('call', n, os.getuid() != 0 or 'root')"
    sim = simulator(tool_rounds=3, tool_name="python", tool_arguments={"code": code})
    worker = make_worker(
        sim,
        tools=[{"name": "python", "kind": "python", "session": "rollout", "timeout": "20s"}],
        dataset=[{"prompt": "What is 6 * 7?"}],
        num_generations=2,
        epochs=1,
        max_turns=5,
    )
    worker.start()
    samples = take(worker, 2, within=60.0)
    for sample in samples:
        results = [m["content"] for m in sample.completion if m["role"] == "tool"]
        # Each rollout counts its own calls: its interpreter kept n, its sibling's is apart.
        assert results == ["call 1 True", "call 2 True", "call 3 True"], sample.completion


def test_a_tool_table_is_refused_at_construction_naming_the_key(simulator, make_worker) -> None:
    sim = simulator()
    with pytest.raises(ValueError, match=r"tools\[1\].*`warm` keeps interpreters ready"):
        make_worker(sim, tools=[sync_function, {"name": "py", "kind": "python", "warm": 2}])


def test_many_async_calls_at_once_each_answer_their_own_rollout(simulator, make_worker) -> None:
    """Calls reach the asyncio loop through its inbox (pushed by the engine without the GIL, a
    wake-up only when it was empty): with 64 rollouts calling at once, each of 3 rounds,
    every call is taken, run and answered to the rollout that made it; a lost wake-up would
    leave rollouts waiting and the take below would time out."""
    calls: list[str] = []

    async def echo(expression: str) -> str:
        """Echoes the expression.

        Args:
            expression: The expression.
        """
        calls.append(expression)
        await asyncio.sleep(0)
        return f"echo:{expression}"

    sim = simulator(tool_rounds=3, tool_name="echo")
    prompts = [f"What is {i} * 7?" for i in range(16)]
    worker = make_worker(
        sim, tools=[echo], dataset=[{"prompt": p} for p in prompts], num_generations=4, epochs=1, max_inflight_tasks=64
    )
    worker.start()
    samples = take(worker, 64)
    for sample in samples:
        question = sample.prompt[-1]["content"]
        expression = question.removeprefix("What is ").removesuffix("?")
        tool_messages = [m["content"] for m in sample.completion if m["role"] == "tool"]
        assert tool_messages == [f"echo:{expression}"] * 3, sample.completion
    assert len(calls) == 64 * 3
    worker.check_health(60.0)
