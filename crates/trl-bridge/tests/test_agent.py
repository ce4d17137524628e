"""Loop-owning agents (``agent=``): a Python agent on OpenAI's own client, or an agent
program (the binary's ``[agent]`` table, opencode included), runs each rollout against the
worker's recording proxy, and the rows hold exactly what the simulator sampled."""

from __future__ import annotations

import json
import os
import re
import threading
import uuid
from pathlib import Path
from typing import Any

import async_grpo
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from conftest import cache_dir, os_thread_names, take, turns_of, wait_until

ROOT = Path(__file__).resolve().parents[3]
QUESTIONS = [{"prompt": f"What is {a} + {a + 1}?", "answer": str(2 * a + 1)} for a in (3, 20, 41)]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates an arithmetic expression of two integers.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "Such as 3 + 4."}},
                "required": ["expression"],
            },
        },
    }
]


def calculate(expression: str) -> str:
    a, op, b = expression.split()
    return str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression of two integers.

    Args:
        expression: Such as 3 + 4.
    """
    return calculate(expression)


def opening(task: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a careful calculator. Use the calculator tool."},
        {"role": "user", "content": task["prompt"][-1]["content"]},
    ]


def answered(messages: list[dict[str, Any]], content: str, calls: list[dict[str, Any]]) -> bool:
    """Appends an answer as agents keep it (arguments re-serialized, compact), and the tool
    results; whether the model called a tool."""
    for call in calls:
        arguments = json.loads(call["function"]["arguments"])
        call["function"]["arguments"] = json.dumps(arguments, separators=(",", ":"))
    answer: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        answer["tool_calls"] = calls
    messages.append(answer)
    for call in calls:
        expression = json.loads(call["function"]["arguments"])["expression"]
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": calculate(expression)})
    return bool(calls)


def graded(task: dict[str, Any], content: str, workdir: str) -> float:
    Path(workdir, "answer.txt").write_text(content)
    return 1.0 if task["answer"] in content else 0.0


def plain_agent(task: dict[str, Any], *, base_url: str, api_key: str, workdir: str) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = opening(task)
    content = ""
    for _ in range(4):
        response = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=512)
        message = response.choices[0].message
        content = message.content or ""
        if not answered(messages, content, [c.model_dump() for c in message.tool_calls or []]):
            break
    return graded(task, content, workdir)


def streaming_agent(task: dict[str, Any], **kwargs: Any) -> float:
    client = OpenAI(base_url=kwargs["base_url"], api_key=kwargs["api_key"], max_retries=0)
    messages = opening(task)
    content = ""
    for _ in range(4):
        chunks = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True}
        )
        content, calls = "", {}
        for chunk in chunks:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    slot = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                    slot["id"] = call.id or slot["id"]
                    if call.function is not None:
                        slot["name"] += call.function.name or ""
                        slot["arguments"] += call.function.arguments or ""
        tool_calls = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())
        ]
        if not answered(messages, content, tool_calls):
            break
    return graded(task, content, kwargs["workdir"])


async def async_agent(task: dict[str, Any], *, base_url: str, api_key: str, workdir: str) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = opening(task)
    content = ""
    for _ in range(4):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        content = message.content or ""
        if not answered(messages, content, [c.model_dump() for c in message.tool_calls or []]):
            break
    await client.close()
    return graded(task, content, workdir)


def assert_exact(samples: list[Any], transcript: list[Any], answers: int, side: int = 0) -> None:
    """Each sample is one rollout of `answers` answers, its masked tokens exactly what the
    simulator sampled, and every answer sampled is in exactly one sample, but for `side`
    answers of the agents' side conversations (sampled, counted, not trained on)."""
    used = 0
    for sample in samples:
        turns = turns_of(sample, transcript)
        assert len(turns) == answers, f"{len(turns)} of the simulator's answers in {sample.completion}"
        mask = [0] * len(sample.input_ids)
        for prompt_ids, token_ids, _logprobs, _finish in turns:
            mask[len(prompt_ids) : len(prompt_ids) + len(token_ids)] = [1] * len(token_ids)
        assert sample.completion_mask.tolist() == mask, "trained on exactly the sampled tokens"
        last_prompt, last_ids = turns[-1][0], turns[-1][1]
        assert sample.input_ids.tolist() == last_prompt + last_ids, "the row ends with the last answer"
        used += len(turns)
    assert used + side == len(transcript), "every answer the simulator gave is in exactly one sample"


@pytest.mark.parametrize("agent", [plain_agent, streaming_agent, async_agent])
def test_a_python_agent_on_openai_s_client_gives_one_exact_row_per_rollout(simulator, make_worker, agent) -> None:
    sim = simulator(tool_rounds=1, tool_name="calculator")
    threads_before = os_thread_names()
    python_before = {t.name for t in threading.enumerate()}
    worker = make_worker(sim, reward_funcs=None, agent=agent, dataset=QUESTIONS, num_generations=2, epochs=1)
    worker.start()
    samples = take(worker, 6)
    wait_until(lambda: worker._pump is not None and not worker._pump.is_alive(), 20.0, "the loop to end")
    worker.check_health(60.0)
    assert_exact(samples, sim.transcript(), answers=2)
    for sample in samples:
        # The agent's own prompt, then its transcript with the proxy's answers.
        assert [m["role"] for m in sample.prompt] == ["system", "user"]
        assert [m["role"] for m in sample.completion] == ["assistant", "tool", "assistant"]
        assert sample.completion[0]["tool_calls"][0]["function"]["name"] == "calculator"
        # Its re-serialized copy of the first answer was replaced by the sampled ids.
        assert sample.metrics["rollout/capture_reused_turns"] == 1.0
        # What the agent returned is the `env` column.
        row = next(q for q in QUESTIONS if q["prompt"] == sample.prompt[1]["content"])
        expected = 1.0 if row["answer"] in sample.completion[-1]["content"] else 0.0
        assert sample.metrics["rewards/env"] == expected
        assert sample.metrics["rollout/agent_reward"] == expected
    worker.stop()
    # None left behind. (A thread of an earlier test that ends meanwhile is no leak of this one.)
    assert {t.name for t in threading.enumerate()} - python_before == set()
    wait_until(lambda: os_thread_names() == threads_before, 20.0, f"the engine's threads to exit ({os_thread_names()})")


class Verifier:
    """An environment that opens a session per rollout and judges the agent's transcript."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sessions: list[VerifierSession] = []

    def create(self, task: dict[str, Any], seed: Any = None, episode_id: Any = None) -> VerifierSession:
        with self.lock:
            session = VerifierSession(task, len(self.sessions))
            self.sessions.append(session)
            return session


class VerifierSession:
    def __init__(self, task: dict[str, Any], index: int) -> None:
        self.task = task
        self.index = index
        self.transcripts: list[list[dict[str, Any]]] = []
        self.closed = 0

    def list_tools(self) -> list[Any]:
        return []

    def verify(self, transcript: list[dict[str, Any]], final_state: Any = None) -> dict[str, Any]:
        self.transcripts.append(transcript)
        return {"env_reward": 10.0 + self.index, "done": True, "metrics": {"session": self.index}}

    def close(self) -> None:
        self.closed += 1


def test_an_environment_s_verify_judges_the_agent_s_transcript(simulator, make_worker) -> None:
    sim = simulator(tool_rounds=1, tool_name="calculator")
    environment = Verifier()
    worker = make_worker(
        sim, reward_funcs=None, agent=plain_agent, environment=environment, dataset=QUESTIONS[:2],
        num_generations=2, epochs=1,
    )
    worker.start()
    samples = take(worker, 4)
    wait_until(lambda: worker._pump is not None and not worker._pump.is_alive(), 20.0, "the loop to end")
    worker.stop()
    sessions = environment.sessions
    assert len(sessions) == 4
    assert [s.closed for s in sessions] == [1] * 4, "every session closed exactly once"
    for sample in samples:
        session = sessions[int(sample.metrics["rollout/env/session"])]
        # The session got the task, and verify read the agent's whole transcript.
        assert session.task["prompt"][-1]["content"] == sample.prompt[1]["content"]
        assert session.transcripts == [sample.prompt + sample.completion]
        # verify is the `env` column; what the agent returned is kept beside it.
        assert sample.metrics["rewards/env"] == 10.0 + session.index
        assert sample.metrics["rollout/agent_reward"] in (0.0, 1.0)


def test_a_request_with_another_key_is_refused_and_samples_nothing(simulator, make_worker) -> None:
    refused: list[int] = []

    def prying_agent(task: dict[str, Any], *, base_url: str, api_key: str, workdir: str) -> float:
        for key in (api_key[::-1], "", api_key + "0"):
            try:
                OpenAI(base_url=base_url, api_key=key or "none", max_retries=0).chat.completions.create(
                    model="policy", messages=opening(task)
                )
            except openai.AuthenticationError as error:
                refused.append(error.status_code)
        return plain_agent(task, base_url=base_url, api_key=api_key, workdir=workdir)

    sim = simulator(tool_rounds=1, tool_name="calculator")
    worker = make_worker(sim, reward_funcs=None, agent=prying_agent, dataset=QUESTIONS[:1], num_generations=2, epochs=1)
    worker.start()
    samples = take(worker, 2)
    wait_until(lambda: worker._pump is not None and not worker._pump.is_alive(), 20.0, "the loop to end")
    assert refused == [401] * 6
    # The refused requests sampled nothing: the rows are the agents' own turns only.
    assert_exact(samples, sim.transcript(), answers=2)


def test_an_agent_that_raises_fails_its_own_rollout_only(simulator, make_worker) -> None:
    def failing_agent(task: dict[str, Any], *, base_url: str, api_key: str, workdir: str) -> float:
        if "20 + 21" in task["prompt"][-1]["content"]:
            raise RuntimeError("the agent broke")
        return plain_agent(task, base_url=base_url, api_key=api_key, workdir=workdir)

    sim = simulator(tool_rounds=1, tool_name="calculator")
    worker = make_worker(
        sim, reward_funcs=None, agent=failing_agent, dataset=QUESTIONS[:2], num_generations=2, epochs=1,
        retries=0, max_failure_rate=None,
    )
    worker.start()
    samples = take(worker, 2)
    wait_until(lambda: worker._pump is not None and not worker._pump.is_alive(), 20.0, "the loop to end")
    worker.check_health(60.0)
    assert {s.prompt[1]["content"] for s in samples} == {"What is 3 + 4?"}
    assert worker.rollout_buffer.empty()
    stats = worker.stats()
    assert stats["rollouts_failed"] == 2.0
    assert stats.get("failures/agent") == 2.0, {k: v for k, v in stats.items() if k.startswith("fail")}


def test_an_agent_that_never_calls_the_model_is_unscorable(simulator, make_worker) -> None:
    def idle_agent(task: dict[str, Any], **kwargs: Any) -> float:
        return 1.0

    sim = simulator()
    worker = make_worker(
        sim, reward_funcs=None, agent=idle_agent, dataset=QUESTIONS[:1], num_generations=2, epochs=1,
        retries=0, max_failure_rate=None,
    )
    worker.start()
    wait_until(lambda: worker._pump is not None and not worker._pump.is_alive(), 20.0, "the loop to end")
    assert worker.rollout_buffer.empty(), "no turn, no row"
    assert worker.stats()["failures/empty_trace"] == 2.0


def test_a_program_is_the_binary_s_agent_table_and_wrong_keys_are_named(simulator, make_worker) -> None:
    sim = simulator()
    with pytest.raises(ValueError, match="agent: unknown field `comand`"):
        make_worker(sim, reward_funcs=None, agent={"comand": ["true"]})
    with pytest.raises(ValueError, match="agent: command: program 'no-such-agent' not found: not on PATH"):
        make_worker(sim, reward_funcs=None, agent={"command": ["no-such-agent"]})
    with pytest.raises(ValueError, match="agent: timeout"):
        make_worker(sim, reward_funcs=None, agent={"command": ["true"], "timeout": 0})
    with pytest.raises(ValueError, match="give tools= or agent=, not both"):
        make_worker(sim, reward_funcs=None, agent=plain_agent, tools=[calculator])
    with pytest.raises(TypeError, match="agent must be a mapping"):
        make_worker(sim, reward_funcs=None, agent=42)


def marked() -> tuple[dict[str, str], str]:
    """An environment variable for an agent table's `env`, and its text as a process's
    environment holds it: every process of the agent's runs inherits it."""
    value = uuid.uuid4().hex
    return {"ASYNC_GRPO_TEST_MARK": value}, f"ASYNC_GRPO_TEST_MARK={value}"


def processes_running(mark: str) -> list[str]:
    """Command lines of this machine's processes whose environment holds `mark` (other runs'
    agents, on the same machine, are not this test's)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if mark.encode() not in environ:
                continue
            found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


def test_an_agent_program_runs_sandboxed_and_reaches_its_proxy(simulator, make_worker) -> None:
    python = cache_dir() / "venv-agents" / "bin" / "python"
    assert python.is_file(), f"{python} is missing: run `cargo xtask fixtures`"
    fixtures = ROOT / "crates" / "cli" / "tests" / "fixtures" / "agent"
    sim = simulator(tool_rounds=1, tool_name="calculator")
    env, mark = marked()
    worker = make_worker(
        sim,
        reward_funcs=None,
        agent={
            "env": env,
            "command": [str(python), str(fixtures / "openai_agent.py"), "plain", "{prompt}"],
            "verify": [str(python), str(fixtures / "verify.py"), "{task_json}"],
            "timeout": 60,
        },
        dataset=QUESTIONS[:2],
        num_generations=2,
        epochs=1,
    )
    worker.start()
    samples = take(worker, 4, within=120.0)
    wait_until(lambda: worker._pump is not None and not worker._pump.is_alive(), 60.0, "the loop to end")
    worker.check_health(600.0)
    worker.stop()
    assert_exact(samples, sim.transcript(), answers=2)
    for sample in samples:
        assert [m["role"] for m in sample.completion] == ["assistant", "tool", "assistant"]
        # verify read the answer the agent wrote in its directory: its last number.
        row = next(q for q in QUESTIONS if q["prompt"] == sample.prompt[1]["content"])
        numbers = re.findall(r"-?\d+", sample.completion[-1]["content"])
        expected = 1.0 if numbers and numbers[-1] == row["answer"] else 0.0
        assert sample.metrics["rewards/env"] == expected
    assert processes_running(mark) == []


def test_opencode_runs_each_rollout_and_its_rows_are_exact(make_worker) -> None:
    """The binary's agent example through the bridge: opencode (the pinned package the
    fixtures install) in the engine's sandbox, verify.py judging the file it wrote."""
    opencode = cache_dir() / "opencode" / "node_modules" / ".bin" / "opencode"
    assert opencode.is_file(), f"{opencode} is missing: run `cargo xtask fixtures`"
    example = ROOT / "examples" / "agent"
    quickstart = str(ROOT / "examples" / "quickstart")
    sim = async_grpo.Simulator(
        quickstart,
        tool_rounds=1,
        tool_name="write",
        tool_arguments={"filePath": "solution.py", "content": "def solve():\n    return {answer}\n"},
        answer_tokens=8,
        max_model_len=65536,
    )
    env, mark = marked()
    try:
        tasks = [json.loads(line) for line in (example / "tasks.jsonl").read_text().splitlines()[:1]]
        worker = make_worker(
            sim,
            processing_class=quickstart,
            reward_funcs=None,
            agent={
                "env": env,
                "command": [str(example / "opencode-agent.sh"), "{prompt}"],
                "verify": ["python3", str(example / "verify.py")],
                "timeout": "3m",
                # Where the fixtures installed opencode: the sandbox shows nothing else of $HOME.
                "home": [".cache/async-grpo"],
            },
            dataset=tasks,
            num_generations=2,
            max_turns=6,
            max_tokens=256,
            epochs=1,
        )
        worker.start()
        # The mark finds the agents' processes (so that finding none at the end means something).
        wait_until(lambda: processes_running(mark) != [], 120.0, "opencode to start, marked")
        samples = take(worker, 2, within=300.0)
        wait_until(lambda: worker._pump is not None and not worker._pump.is_alive(), 60.0, "the loop to end")
        worker.check_health(600.0)
        worker.stop()
        # opencode also asks for a title for its session: a side conversation, no row.
        assert [s.metrics["rollout/agent_side_conversations"] for s in samples] == [1.0, 1.0]
        side = int(sum(s.metrics["rollout/agent_side_turns"] for s in samples))
        assert_exact(samples, sim.transcript(), answers=2, side=side)
        for sample in samples:
            call = sample.completion[0]["tool_calls"][0]["function"]
            assert call["name"] == "write"
            assert sample.completion[1]["role"] == "tool"
            # verify ran the solve() of the file opencode wrote: right exactly when the model
            # wrote the answer.
            arguments = call["arguments"] if isinstance(call["arguments"], dict) else json.loads(call["arguments"])
            right = arguments["content"].rstrip().endswith(f"return {tasks[0]['answer']}")
            assert sample.metrics["rewards/env"] == (1.0 if right else 0.0)
    finally:
        sim.stop()
    assert processes_running(mark) == []
