"""The same workloads through async_grpo.RolloutWorker and TRL 1.16's own AsyncRolloutWorker,
against the same simulator (a process of its own), with the same Python tools and reward; and
the single-turn and 32-tool-round workloads through the `async-grpo` binary too (`--binary`),
the same rollouts from a JSONL dataset with a built-in reward and tool of the same cost class.

For each workload and worker: turns per second (the simulator's completions over a window of
`--seconds` of steady state, after the first sample, while the trainer thread takes samples
as fast as they come), CPU per turn (the worker's process and its children,
the simulator excluded; and the same less what the tools and rewards burn by design), and
the trainer thread's lag (a thread of the trainer's process that wants to wake every 10 ms:
how late it woke, p99 and max, over the window).

Run in the TRL venv `cargo xtask trl` builds, or through `cargo xtask bench trl`, which
installs the release wheel, builds the release binary and runs this with `--binary` and a
20 ms latency, printing each worker's CPU per turn as a ratio to TRL's:
    ~/.cache/async-grpo/trl-venv/bin/python crates/trl-bridge/bench/compare_trl.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

SIM_SCRIPT = """
import sys, async_grpo
sim = async_grpo.Simulator(sys.argv[1], tool_rounds=int(sys.argv[2]), tool_name=sys.argv[3], answer_tokens=24,
                           model="sim", max_model_len=8192, latency=sys.argv[4])
print(sim.url, flush=True)
for line in sys.stdin:  # each line asks how many completions it served
    print(sim.completions(), flush=True)
sim.stop()
"""


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: Two integers and an operator, such as "3 + 4".
    """
    return expression


def sleepy(expression: str) -> str:
    """Waits 100 ms, as an HTTP call would.

    Args:
        expression: The expression.
    """
    time.sleep(0.1)
    return expression


async def asleepy(expression: str) -> str:
    """Waits 100 ms, asynchronously.

    Args:
        expression: The expression.
    """
    await asyncio.sleep(0.1)
    return expression


def burner(expression: str) -> str:
    """Burns 5 ms of Python CPU.

    Args:
        expression: The expression.
    """
    end = time.thread_time() + 0.005
    x = 0
    while time.thread_time() < end:
        x += 1
    return expression


def reward(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    return [float(len(c[-1]["content"]) % 2) for c in completions]


def burning_reward(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """Burns 5 ms of Python CPU per group, as a verifier written in Python would."""
    end = time.thread_time() + 0.005
    x = 0
    while time.thread_time() < end:
        x += 1
    return [float(len(c[-1]["content"]) % 2) for c in completions]


# name: (tool rounds, tool, reward, CPU seconds the tool burns per call and the reward per group)
WORKLOADS = {
    "single turn": (0, None, reward, 0.0, 0.0),
    "sync tool sleeping 100 ms, 2 rounds": (2, sleepy, reward, 0.0, 0.0),
    "async tool sleeping 100 ms, 2 rounds": (2, asleepy, reward, 0.0, 0.0),
    "sync tool and reward burning 5 ms CPU, 2 rounds": (2, burner, burning_reward, 0.005, 0.005),
    "32 tool rounds": (32, calculator, reward, 0.0, 0.0),
}
GENERATIONS = 8


class Ticker:
    """The trainer's thread: wakes every 10 ms and records how late it woke."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            before = time.perf_counter()
            time.sleep(0.01)
            self.lags.append(time.perf_counter() - before - 0.01)


def cpu_seconds() -> float:
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            if child.pid != SIM_PID:
                total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


SIM_PID = -1
OPTIONS: dict[str, Any] = {}


def run_one(
    kind: str, workload: tuple[Any, ...], url: str, tokenizer_dir: str, seconds: float, counter: Any
) -> dict[str, float]:
    rounds, tool, reward_func, tool_burn, reward_burn = workload
    from datasets import Dataset
    from transformers import AutoTokenizer

    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {a + 3}?"}]} for a in range(64)]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tools = [tool] if tool is not None else None
    if kind == "async_grpo":
        import async_grpo

        worker: Any = async_grpo.RolloutWorker(
            model_name="sim", dataset=rows, reward_funcs=[reward_func], tools=tools, processing_class=tokenizer,
            vllm_server_url=url, num_generations=GENERATIONS, max_inflight_tasks=64, max_tokens=64, max_turns=40,
            **OPTIONS,
        )
    else:
        from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

        worker = AsyncRolloutWorker(
            model_name="sim", dataset=Dataset.from_list(rows), reward_funcs=[reward_func], tools=tools,
            processing_class=tokenizer, eos_token_ids=[tokenizer.eos_token_id], num_generations=GENERATIONS,
            max_inflight_tasks=64, vllm_server_url=url, max_tokens=64,
        )
    ticker = Ticker()
    worker.start()
    try:
        worker.rollout_buffer.get(timeout=300)
        ticker.thread.start()
        turns0, cpu0, t0 = counter(), cpu_seconds(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            worker.rollout_buffer.get(timeout=300)
        turns1, cpu1, t1 = counter(), cpu_seconds(), time.perf_counter()
    finally:
        ticker.stop.set()
        worker.stop()
    turns = turns1 - turns0
    lags = sorted(ticker.lags) or [0.0]
    # What the tools and rewards burn by design: a rollout of `rounds` tool calls has
    # `rounds + 1` turns, a group `GENERATIONS` rollouts.
    burned = turns * (rounds * tool_burn + reward_burn / GENERATIONS) / (rounds + 1)
    return {
        "turns_per_s": turns / (t1 - t0),
        "cpu_ms_per_turn": 1e3 * (cpu1 - cpu0) / max(turns, 1),
        "cpu_ms_per_turn_less_burn": 1e3 * (cpu1 - cpu0 - burned) / max(turns, 1),
        "lag_p99_ms": 1e3 * lags[int(0.99 * (len(lags) - 1))],
        "lag_max_ms": 1e3 * lags[-1],
    }


def run_binary(
    binary: str, workload: tuple[Any, ...], url: str, tokenizer_dir: str, seconds: float, counter: Any
) -> dict[str, float]:
    """The `async-grpo` binary on the single-turn workload, and on the 32 tool rounds with its
    built-in `calculator` tool (run on its tool pool, as a sync tool): the same 64 prompts (over
    and over, `--epochs`, so that the window never runs out of them), groups of 8, 64 in flight,
    64 tokens, rows written as JSONL, the built-in `length` reward. CPU is the whole process's
    (every thread), over the same window of steady state as the workers'; `startup_cpu_s` is
    what it spent before its first answer (tokenizer, template, connections)."""
    import tempfile

    # The rows it writes (tens of MB a run) go with the folder.
    with tempfile.TemporaryDirectory(prefix="async-grpo-bench-") as folder:
        return measure_binary(binary, workload[0], Path(folder), url, tokenizer_dir, seconds, counter)


def measure_binary(
    binary: str, rounds: int, scratch: Path, url: str, tokenizer_dir: str, seconds: float, counter: Any
) -> dict[str, float]:
    """The run of `run_binary`, with its files in `scratch`."""
    import json

    dataset = scratch / "prompts.jsonl"
    with dataset.open("w") as out:
        for a in range(64):
            out.write(json.dumps({"prompt": f"What is {a} + {a + 3}?", "answer": str(2 * a + 3)}) + "\n")
    command = [
        binary, "rollout", "--server", url, "--model", "sim", "--tokenizer", tokenizer_dir,
        "--dataset", str(dataset), "--epochs", "100000", "--out", str(scratch / "rows.jsonl"), "--overwrite",
        "--num-generations", str(GENERATIONS), "--max-inflight", "64", "--max-tokens", "64", "--max-turns", "40",
        "--reward", "length:64", "--progress", "off",
    ]
    if rounds:
        config = scratch / "rollout.toml"
        config.write_text('[[tools]]\nname = "calculator"\nkind = "calculator"\n')
        command += ["--config", str(config)]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ps = psutil.Process(process.pid)
    try:
        begun = counter()
        while counter() == begun:
            if process.poll() is not None:
                raise SystemExit(f"the binary stopped: {process.stderr.read() if process.stderr else ''}")
            time.sleep(0.005)
        startup_cpu = sum(ps.cpu_times()[:2])
        startup_s = time.perf_counter() - started
        time.sleep(1.0)  # past the first groups, as the workers' window starts after a sample
        turns0, cpu0, t0 = counter(), sum(ps.cpu_times()[:2]), time.perf_counter()
        time.sleep(seconds)
        turns1, cpu1, t1 = counter(), sum(ps.cpu_times()[:2]), time.perf_counter()
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
    turns = turns1 - turns0
    return {
        "turns_per_s": turns / (t1 - t0),
        "cpu_ms_per_turn": 1e3 * (cpu1 - cpu0) / max(turns, 1),
        "cpu_ms_per_turn_less_burn": 1e3 * (cpu1 - cpu0) / max(turns, 1),
        "lag_p99_ms": float("nan"),
        "lag_max_ms": float("nan"),
        "startup_cpu_s": startup_cpu,
        "startup_s": startup_s,
    }


def with_trl_template(tokenizer_dir: str, out: Path) -> str:
    """The tokenizer with TRL's own Qwen3 chat template (the one TRL knows how to parse
    responses of), saved for both workers to load."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = qwen3_chat_template
    tokenizer.save_pretrained(out)
    return str(out)


def main() -> None:
    global SIM_PID  # noqa: PLW0603
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", default=str(Path.home() / ".cache/async-grpo/qwen3"))
    parser.add_argument("--seconds", type=float, default=10.0, help="the measured window, after the first sample")
    parser.add_argument("--only", default=None, help="run only the workloads whose name contains this")
    parser.add_argument("--python-tool-threads", type=int, default=None, help="the bridge's python_tool_threads")
    parser.add_argument("--python-processes", type=int, default=None, help="the bridge's python_processes")
    parser.add_argument("--nice", type=int, default=10, help="the bridge's nice")
    parser.add_argument(
        "--workers", default="async_grpo,trl", help="which workers to run, comma-separated (async_grpo, trl, binary)"
    )
    parser.add_argument("--binary", default=None, help="the async-grpo binary, for the `binary` worker")
    parser.add_argument("--latency", default="0ms", help="the simulator's latency per request, such as 20ms")
    args = parser.parse_args()
    OPTIONS.update(
        python_tool_threads=args.python_tool_threads, python_processes=args.python_processes, nice=args.nice
    )
    import tempfile

    args.tokenizer = with_trl_template(args.tokenizer, Path(tempfile.mkdtemp(prefix="wt12-bench-")))
    results = []
    for name, workload in WORKLOADS.items():
        rounds, tool = workload[:2]
        if args.only and args.only not in name:
            continue
        for kind in args.workers.split(","):
            if kind == "binary" and rounds and tool is not calculator:
                continue  # the binary's tools are its own: only the calculator has a twin
            sim = subprocess.Popen(
                [
                    sys.executable, "-c", SIM_SCRIPT, args.tokenizer, str(rounds),
                    tool.__name__ if tool else "calculator", args.latency,
                ],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            SIM_PID = sim.pid
            assert sim.stdin is not None and sim.stdout is not None
            url = sim.stdout.readline().strip()

            def count(sim: subprocess.Popen = sim) -> int:
                assert sim.stdin is not None and sim.stdout is not None
                sim.stdin.write("?\n")
                sim.stdin.flush()
                return int(sim.stdout.readline())

            try:
                if kind == "binary":
                    if not args.binary:
                        raise SystemExit("--workers binary needs --binary PATH")
                    result = run_binary(args.binary, workload, url, args.tokenizer, args.seconds, count)
                else:
                    result = run_one(kind, workload, url, args.tokenizer, args.seconds, count)
            finally:
                if sim.stdin:
                    sim.stdin.close()
                sim.wait(30)
            results.append((name, kind, result))
            print(f"{name:40s} {kind:10s} " + "  ".join(f"{k}={v:.2f}" for k, v in result.items()), flush=True)
    print()
    print(f"simulator latency {args.latency}, {GENERATIONS} generations a group, 64 in flight, {args.seconds:.0f} s windows")
    print()
    print(
        "| workload | worker | turns/s | CPU ms/turn | less the burn | TRL's CPU per turn over this one's "
        "| trainer-thread lag p99 / max (ms) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    labels = {"async_grpo": "async_grpo.RolloutWorker", "trl": "TRL AsyncRolloutWorker", "binary": "async-grpo binary"}
    for name, kind, r in results:
        trl = next((t for n, k, t in results if n == name and k == "trl"), None)
        ratio = f"{trl['cpu_ms_per_turn_less_burn'] / r['cpu_ms_per_turn_less_burn']:.1f}x" if trl else "-"
        lag = "-" if kind == "binary" else f"{r['lag_p99_ms']:.1f} / {r['lag_max_ms']:.1f}"
        print(
            f"| {name} | {labels[kind]} | {r['turns_per_s']:.0f} | {r['cpu_ms_per_turn']:.3f} | "
            f"{r['cpu_ms_per_turn_less_burn']:.3f} | {ratio} | {lag} |"
        )
    for name, kind, r in results:
        if kind == "binary":
            print(f"\nthe binary's start-up: {r['startup_cpu_s']:.2f} s of CPU, {r['startup_s']:.2f} s to its first answer")


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from accelerate import PartialState

    PartialState()  # TRL's worker logs through accelerate, which wants its state first
    main()
