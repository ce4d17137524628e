"""TRL's AsyncGRPOTrainer trains a model on the rollouts of a coding agent that owns its loop.

Every rollout is one run of an agent on a small coding task ("Write solution.py with a
function solve() that returns 6 * 7."): opencode (https://opencode.ai), run by the engine in
its sandbox, or the small Python agent below, both talking to the worker's recording proxy as
if it were an OpenAI server. The engine samples every turn they ask for, so the rows the
trainer reads hold exactly the tokens the model sampled. An OpenEnv-shaped session per
rollout judges the agent's transcript: it takes the solution.py the agent wrote and runs
the task's test on it (examples/agent/verify.py) under bubblewrap. Its reward is the `env`
column; there are no other reward functions.

    python train.py                          # opencode, offline: the simulator plays the model
    python train.py --agent python           # the Python agent instead of opencode
    python train.py --vllm-url http://localhost:8000 --model Qwen/Qwen3-8B   # a real model

Offline, `async_grpo.Simulator` (examples/agent/agent.toml's [simulator]: a model that
writes solution.py with the `write` tool, right half of the time, then answers) stands in
for vLLM, and a tiny random-weight Qwen3 with the real Qwen3 tokenizer is trained on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import trl.experimental.async_grpo as ag  # TRL 1.16; from 1.18: `import trl as ag`
from datasets import Dataset
from openai import OpenAI
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from async_grpo import RolloutWorker, Simulator

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import cpu  # noqa: E402  # TRL's CUDA-only pieces replaced for a CPU

logger = logging.getLogger("trl-opencode")

# The test of a task, the agent example's: the dataset row as JSON on stdin, in a directory
# holding solution.py; exit 0 is reward 1.0, exit 1 is 0.0.
VERIFY = HERE.parent / "agent" / "verify.py"

# opencode as the engine runs it: the binary's [agent] table (examples/agent/agent.toml's,
# without its verify: the session below judges). Its path is absolute, so that the script
# runs from any directory; `home` shows the sandbox where opencode is installed.
OPENCODE = {
    "command": [str(HERE.parent / "agent" / "opencode-agent.sh"), "{prompt}"],
    "timeout": "3m",
    "home": [".cache/async-grpo"],
}

# The simulator's settings: examples/agent/agent.toml's [simulator] table.
SIMULATOR = {
    "tool_rounds": 1,
    "tool_name": "write",
    "tool_arguments": {"filePath": "solution.py", "content": "def solve():\n    return {answer}\n"},
    "answer_tokens": 8,
    "max_model_len": 65536,
}


def tasks(count: int = 32, seed: int = 0) -> Dataset:
    """Small coding tasks: write solution.py whose solve() returns `A op B`; `answer` is
    its value."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        prompt = f"Write solution.py with a function solve() that returns {a} {op} {b}."
        rows.append({"prompt": prompt, "answer": str(value)})
    return Dataset.from_list(rows)


def task_text(task: dict[str, Any]) -> str:
    """The task's text: the prompt, or its last message's content."""
    prompt = task["prompt"]
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


# --- The environment: an OpenEnv-shaped session per rollout, judging what the agent wrote.


def written_solution(transcript: list[dict[str, Any]]) -> str | None:
    """The content of the last `write` call to solution.py in the transcript (opencode's
    `write` tool and the Python agent's take `filePath` and `content`), or None."""
    solution = None
    for message in transcript:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            if function.get("name") != "write":
                continue
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    continue
            if not isinstance(arguments, dict):
                continue
            path, content = arguments.get("filePath"), arguments.get("content")
            if isinstance(path, str) and Path(path).name == "solution.py" and isinstance(content, str):
                solution = content
    return solution


def run_test(task: dict[str, Any], solution: str) -> float | None:
    """verify.py on `solution` in a fresh directory: 1.0 when it passes, 0.0 when it fails,
    None when the test could not judge (an error, or past 60 s)."""
    # The solution is the policy's code: it runs under bubblewrap, not with the trainer's
    # permissions. Everything is read-only but the fresh directory and a private /tmp, with
    # no network, no view of the trainer's processes, and nothing left when it exits.
    with tempfile.TemporaryDirectory(prefix="trl-opencode-test-") as folder:
        Path(folder, "solution.py").write_text(solution)
        command = [
            "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
            "--bind", folder, folder, "--chdir", folder,
            "--unshare-all", "--die-with-parent", "--new-session",
            "python3", str(VERIFY),
        ]  # fmt: skip
        row = json.dumps(task, default=str).encode()
        try:
            done = subprocess.run(command, input=row, capture_output=True, timeout=60)
        except subprocess.TimeoutExpired:
            logger.warning("the test ran past 60 s")
            return None
    if done.returncode in (0, 1):
        return 1.0 if done.returncode == 0 else 0.0
    logger.warning("the test could not judge (exit %s): %s", done.returncode, done.stderr.decode(errors="replace"))
    return None


class SolutionTest:
    """One rollout's session: no tools of its own (the agent brings them); `verify` runs the
    task's test on the solution.py the agent wrote."""

    def __init__(self, task: dict[str, Any]) -> None:
        self.task = task

    def list_tools(self) -> list[Any]:
        return []

    def verify(self, transcript: list[dict[str, Any]], final_state: Any = None) -> dict[str, Any]:
        solution = written_solution(transcript)
        if solution is None:
            return {"env_reward": 0.0, "done": True, "metrics": {"wrote_solution": 0.0}}
        return {"env_reward": run_test(self.task, solution), "done": True, "metrics": {"wrote_solution": 1.0}}

    def close(self) -> None:
        pass


class SolutionTests:
    """The session factory (OpenEnv's `create(task, seed=None, episode_id=None)`)."""

    def create(self, task: dict[str, Any], seed: int | None = None, episode_id: str | None = None) -> SolutionTest:
        return SolutionTest(task)


# --- The Python agent: an OpenAI-client loop with one tool, `write`.

WRITE_TOOL = {
    "type": "function",
    "function": {
        "name": "write",
        "description": "Writes a file in the working directory, replacing it if it exists.",
        "parameters": {
            "type": "object",
            "properties": {
                "filePath": {"type": "string", "description": "The file's path, such as solution.py."},
                "content": {"type": "string", "description": "The file's whole content."},
            },
            "required": ["filePath", "content"],
        },
    },
}
SYSTEM = "You are a coding agent. Write files with the write tool; when the task is done, say so briefly."


def write(workdir: str, arguments: str) -> str:
    """The `write` tool: the file written inside `workdir`, or an error the model reads."""
    try:
        parsed = json.loads(arguments)
        path, content = parsed["filePath"], parsed["content"]
        root = Path(workdir).resolve()
        target = (root / path).resolve()
        if not target.is_relative_to(root) or target == root:
            return f"Error: {path} is outside the working directory"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
    except (ValueError, KeyError, TypeError, OSError) as error:
        return f"Error: {type(error).__name__}: {error}"
    return "Wrote file successfully."


def python_agent(task: dict[str, Any], *, base_url: str, api_key: str, workdir: str) -> None:
    """Calls the model until it answers without a tool call; runs its `write` calls in
    `workdir`. The session's verify judges the transcript, so nothing is returned."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task_text(task)},
    ]
    with OpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for _ in range(8):
            choice = client.chat.completions.create(model="policy", messages=messages, tools=[WRITE_TOOL]).choices[0]
            calls = choice.message.tool_calls or []
            answer: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
            if calls:
                answer["tool_calls"] = [call.model_dump() for call in calls]
            messages.append(answer)
            if not calls or choice.finish_reason == "length":
                return
            for call in calls:
                if call.function.name == "write":
                    result = write(workdir, call.function.arguments)
                else:
                    result = f"Error: no tool named {call.function.name}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


# --- Training.


def cache_dir() -> Path:
    """Where `cargo xtask fixtures` puts the real tokenizers."""
    if os.environ.get("ASYNC_GRPO_CACHE"):
        return Path(os.environ["ASYNC_GRPO_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "async-grpo"


def tiny_qwen3(folder: Path, tokenizer_dir: Path) -> None:
    """A random-weight Qwen3 small enough to train on a CPU, with the real Qwen3 tokenizer."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=SIMULATOR["max_model_len"],
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)


def train(
    *,
    agent: str,
    vllm_url: str | None = None,
    model: str | None = None,
    max_steps: int = 3,
    output_dir: str | os.PathLike[str] = "trl-opencode-out",
    num_generations: int = 4,
    max_inflight: int = 4,
    max_tokens: int = 1024,
    learning_rate: float = 1e-6,
) -> ag.AsyncGRPOTrainer:
    """Trains for `max_steps` optimizer steps on the rollouts of `agent` ("opencode" or
    "python"): against the vLLM server at `vllm_url` serving `model`, or, without them, the
    simulator and a tiny random Qwen3. Returns the trainer after training."""
    agents: dict[str, Any] = {"opencode": OPENCODE, "python": python_agent}
    if agent not in agents:
        raise ValueError(f"agent must be one of {sorted(agents)}, got {agent!r}")
    if (vllm_url is None) != (model is None):
        raise ValueError("give both a vLLM server's URL and the model it serves, or neither (the simulator)")
    if shutil.which("bwrap") is None:
        raise RuntimeError("bwrap (bubblewrap) is needed: the solutions' tests run under it")
    output_dir = Path(output_dir)
    with contextlib.ExitStack() as cleanup:
        simulator = None
        if vllm_url is None:
            tokenizer_dir = cache_dir() / "qwen3"
            if not (tokenizer_dir / "tokenizer.json").is_file():
                raise RuntimeError(f"{tokenizer_dir} has no tokenizer.json: run `cargo xtask fixtures`")
            model = str(output_dir / "tiny-qwen3")
            tiny_qwen3(Path(model), tokenizer_dir)
            served = "tiny-qwen3"
            simulator = Simulator(str(tokenizer_dir), model=served, **SIMULATOR)
            cleanup.callback(simulator.stop)
            vllm_url = simulator.url
        else:
            served = model
        assert model is not None

        tokenizer = AutoTokenizer.from_pretrained(model)
        dataset = tasks()
        per_step = 2 * num_generations  # each optimizer step trains on 2 tasks' rollouts
        worker = RolloutWorker(
            model_name=served,
            dataset=dataset,
            reward_funcs=None,  # the session's verify is the reward (the `env` column)
            agent=agents[agent],
            environment=SolutionTests(),
            processing_class=tokenizer,
            num_generations=num_generations,
            max_inflight_tasks=max_inflight,
            # Rollouts wait for the trainer at most two optimizer steps' worth ahead (then the
            # engine starts no more): agent runs do not take the CPU a long step needs.
            queue_maxsize=2 * per_step,
            vllm_server_url=vllm_url,
            max_tokens=max_tokens,
            max_turns=8,
            max_staleness=2,
        )
        cleanup.callback(worker.stop)  # the trainer stops it too; stopping twice is harmless
        on_cpu = not torch.cuda.is_available()
        config = ag.AsyncGRPOConfig(
            output_dir=str(output_dir),
            max_steps=max_steps,
            # A fixed count of samples per step (TRL's default packs samples up to the
            # server's max_model_len per step instead).
            per_device_train_batch_size=per_step,
            token_budget=0,
            gradient_accumulation_steps=1,
            num_generations=num_generations,
            max_completion_length=max_tokens,
            learning_rate=learning_rate,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=not on_cpu,
            use_cpu=on_cpu,
            dataloader_num_workers=0,
            vllm_server_base_url=vllm_url,
            max_staleness=2,
        )
        if on_cpu:
            cleanup.enter_context(cpu.on_cpu())
        # The simulator holds no weights, and a CPU has no NCCL to send them with: then the
        # trainer sends none. Else TRL's own transfer streams them to vLLM.
        weight_transfer = cpu.NoWeightTransfer() if simulator is not None or on_cpu else None
        trainer = ag.AsyncGRPOTrainer(
            model=model,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_worker=worker,
            weight_transfer=weight_transfer,
        )
        trainer.train()
    return trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agent", choices=["opencode", "python"], default="opencode")
    p.add_argument("--vllm-url", help="a vLLM server (default: the simulator, offline)")
    p.add_argument("--model", help="the model it serves, a Hub id or a folder (default: a tiny random Qwen3)")
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-inflight", type=int, default=4, help="rollouts (agent runs) at once")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per answer")
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--output-dir", default="trl-opencode-out")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    trainer = train(
        agent=args.agent,
        vllm_url=args.vllm_url,
        model=args.model,
        max_steps=args.max_steps,
        output_dir=args.output_dir,
        num_generations=args.num_generations,
        max_inflight=args.max_inflight,
        max_tokens=args.max_tokens,
        learning_rate=args.learning_rate,
    )
    steps = [log for log in trainer.state.log_history if "loss" in log]
    print(f"{trainer.state.global_step} optimizer steps; the last: {steps[-1] if steps else None}")


if __name__ == "__main__":
    main()
