"""The protocol TRL's trainer calls, the samples' shape, and that they hold exactly what the
model (the simulator) sampled."""

from __future__ import annotations

import dataclasses
import inspect
import queue
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import async_grpo
from conftest import drain_metrics, take, turns_of, wait_until

TRL_FIELDS = [
    "prompt",
    "completion",
    "input_ids",
    "completion_mask",
    "old_log_probs",
    "advantage",
    "model_version",
    "group_id",
    "metrics",
    "enqueued_at",
]
# What the worker's samples carry besides TRL's fields, for off-policy trainers.
PER_TOKEN_FIELDS = ["token_versions", "routed_experts", "routed_experts_missing"]


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: Two integers and an operator, such as "3 + 4".
    """
    left, operator, right = expression.split()
    a, b = int(left), int(right)
    return str({"+": a + b, "-": a - b, "*": a * b}.get(operator, 0))


def test_the_worker_has_the_shape_of_trl_s_rollout_worker_protocol(simulator, make_worker) -> None:
    """TRL's protocol and sample, and the per-token fields besides."""
    sim = simulator()
    worker = make_worker(sim)
    assert isinstance(worker.rollout_buffer, queue.Queue)
    assert isinstance(worker.metrics_queue, queue.Queue)
    for method, arity in (("start", 0), ("stop", 0), ("update_model_version", 1), ("check_health", 1)):
        assert len(inspect.signature(getattr(worker, method)).parameters) == arity, method
    assert [f.name for f in dataclasses.fields(async_grpo.RolloutSample)] == TRL_FIELDS + PER_TOKEN_FIELDS
    worker.start()
    [sample] = take(worker, 1)
    assert isinstance(sample, async_grpo.RolloutSample)
    assert sample.input_ids.dtype == np.int64 and sample.input_ids.ndim == 1
    assert sample.completion_mask.dtype == np.int64 and sample.completion_mask.shape == sample.input_ids.shape
    assert sample.old_log_probs.dtype == np.float32 and sample.old_log_probs.shape == sample.input_ids.shape
    assert isinstance(sample.advantage, float) and isinstance(sample.model_version, int)
    assert isinstance(sample.group_id, int) and isinstance(sample.enqueued_at, float)
    # One [start, end, version] row per span, covering exactly the sampled tokens.
    spans = sample.token_versions
    assert spans.dtype == np.int64 and spans.ndim == 2 and spans.shape[1] == 3 and len(spans) >= 1
    covered = np.zeros_like(sample.input_ids)
    for start, end, version in spans:
        covered[start:end] += 1
        assert version <= worker.model_version
    assert (covered == sample.completion_mask).all()
    assert sample.model_version == spans[:, 2].min()
    assert sample.routed_experts is None and sample.routed_experts_missing is None
    assert sample.prompt == [{"role": "user", "content": sample.prompt[0]["content"]}]
    assert sample.completion[-1]["role"] == "assistant"
    assert all(isinstance(value, float) for value in sample.metrics.values())
    assert {"reward", "reward_std", "rewards/default_reward"} <= set(sample.metrics)
    worker.check_health(60.0)
    wait_until(lambda: not worker.metrics_queue.empty(), 10.0, "a metrics item")
    items = drain_metrics(worker)
    for item in items:
        for key, value in item.items():
            assert isinstance(key, str)
            assert isinstance(value, float) or (
                isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, float) for v in value)
            ), (key, value)
    keys = set().union(*items)
    assert {"rollout/completed_total", "rollout/turns_total", "rollout/sampled_tokens_total"} <= keys
    assert {"rollout/buffer_size", "rollout/scheduler_lag_max_s", "rollout/turns_mean"} <= keys
    assert sum(item.get("rollout/completed_total", 0.0) for item in items) >= 1.0


@pytest.mark.parametrize("tool_rounds", [0, 2])
def test_ids_mask_and_logprobs_are_what_the_simulator_sampled(simulator, make_worker, tool_rounds: int) -> None:
    sim = simulator(tool_rounds=tool_rounds)
    worker = make_worker(sim, tools=[calculator] if tool_rounds else None, epochs=1, dataset=[
        {"prompt": "What is 3 + 4?"},
        {"prompt": "What is 6 * 7?"},
    ])
    worker.start()
    samples = take(worker, 8)
    # Every group of the one epoch was delivered: nothing more comes.
    wait_until(lambda: worker._pump is not None and not worker._pump.is_alive(), 10.0, "the loop to end")
    assert worker.rollout_buffer.empty()
    worker.check_health(60.0)
    transcript = sim.transcript()
    assert len(transcript) == 8 * (tool_rounds + 1)
    used = 0
    for sample in samples:
        turns = turns_of(sample, transcript)
        assert len(turns) == tool_rounds + 1, "one turn per answer of the simulator"
        used += len(turns)
        expected_mask = np.zeros(len(sample.input_ids), dtype=np.int64)
        expected_logprobs = np.zeros(len(sample.input_ids), dtype=np.float32)
        for prompt_ids, token_ids, logprobs, _finish in turns:
            expected_mask[len(prompt_ids) : len(prompt_ids) + len(token_ids)] = 1
            expected_logprobs[len(prompt_ids) : len(prompt_ids) + len(token_ids)] = np.asarray(logprobs, np.float32)
        last_prompt, last_ids = turns[-1][0], turns[-1][1]
        assert sample.input_ids.tolist() == last_prompt + last_ids, "the row ends with the last answer"
        np.testing.assert_array_equal(sample.completion_mask, expected_mask)
        np.testing.assert_array_equal(sample.old_log_probs, expected_logprobs)
        assert sample.metrics["rollout/turns"] == float(tool_rounds + 1)
    assert used == len(transcript), "every answer the simulator gave is in exactly one sample"
    group_sizes: dict[int, int] = {}
    for sample in samples:
        group_sizes[sample.group_id] = group_sizes.get(sample.group_id, 0) + 1
    assert group_sizes == {0: 4, 1: 4}


def test_a_tool_call_and_its_result_are_in_the_completion(simulator, make_worker) -> None:
    sim = simulator(tool_rounds=1)
    worker = make_worker(sim, tools=[calculator], dataset=[{"prompt": "What is 6 * 7?"}])
    worker.start()
    [sample, *_] = take(worker, 4)
    call, result, answer = sample.completion
    assert call["tool_calls"][0]["function"]["name"] == "calculator"
    assert result == {"role": "tool", "name": "calculator", "content": "42", "tool_call_id": result["tool_call_id"]}
    assert answer["role"] == "assistant"


BAD_ARGUMENTS = [
    ({"num_generations": 0}, ValueError, "num_generations"),
    ({"num_generations": 2.5}, TypeError, "num_generations"),
    ({"max_inflight_tasks": 0}, ValueError, "max_inflight_tasks"),
    ({"temperature": "hot"}, TypeError, "temperature"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"top_k": -5}, ValueError, "top_k"),
    ({"min_p": 2.0}, ValueError, "min_p"),
    ({"max_tokens": 0}, ValueError, "max_tokens"),
    ({"max_turns": 0}, ValueError, "max_turns"),
    ({"max_staleness": -1}, ValueError, "max_staleness"),
    ({"tool_timeout": 0}, ValueError, "tool_timeout"),
    ({"python_tool_threads": 0}, ValueError, "python_tool_threads"),
    ({"vllm_server_url": "localhost:8000"}, ValueError, "vllm_server_url"),
    ({"vllm_server_url": []}, TypeError, "vllm_server_url"),
    ({"processing_class": "/nonexistent"}, ValueError, "processing_class"),
    ({"processing_class": 42}, TypeError, "processing_class"),
    ({"dataset": []}, ValueError, "dataset"),
    ({"dataset": [{"question": "no prompt"}]}, ValueError, "dataset"),
    ({"dataset": [1, 2]}, TypeError, "dataset[0]"),
    ({"dataset": "prompts.csv"}, ValueError, "dataset"),
    ({"reward_funcs": []}, ValueError, "reward_funcs"),
    ({"reward_funcs": [42]}, TypeError, "reward_funcs[0]"),
    ({"reward_weights": [1.0, 2.0]}, ValueError, "reward_weights"),
    ({"tools": [42]}, TypeError, "tools[0]"),
    ({"tools": [{"function": calculator, "oops": 1}]}, ValueError, "tools[0]"),
    ({"estimator": "ppo"}, ValueError, "estimator"),
    ({"prompt_mode": "sometimes"}, ValueError, "prompt_mode"),
    ({"model_name": ""}, TypeError, "model_name"),
    ({"environment": object()}, TypeError, "environment"),
    ({"not_an_argument": 1}, TypeError, "not_an_argument"),
]


@pytest.mark.parametrize(("options", "error", "names"), BAD_ARGUMENTS, ids=[b[2] for b in BAD_ARGUMENTS])
def test_a_wrong_argument_fails_at_construction_naming_it(
    simulator, make_worker, options: dict[str, Any], error: type[Exception], names: str
) -> None:
    sim = simulator()
    with pytest.raises(error, match=names.replace("[", r"\[").replace("]", r"\]")):
        make_worker(sim, **options)


def test_a_jsonl_path_and_a_tokenizer_object_are_accepted(simulator, make_worker, tokenizer_dir, tmp_path) -> None:
    class Tokenizer:  # what the worker reads of a transformers tokenizer
        name_or_path = tokenizer_dir

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "What is 2 + 3?"}\n')
    sim = simulator()
    worker = make_worker(sim, dataset=str(path), processing_class=Tokenizer(), epochs=1)
    worker.start()
    samples = take(worker, 4)
    assert {s.prompt[0]["content"] for s in samples} == {"What is 2 + 3?"}


def test_free_threaded_cpython_is_refused_with_a_clear_message() -> None:
    # A stable-ABI module cannot load in free-threaded CPython; the package says so at import.
    code = (
        "import sysconfig\n"
        "real = sysconfig.get_config_var\n"
        "sysconfig.get_config_var = lambda name: 1 if name == 'Py_GIL_DISABLED' else real(name)\n"
        "import async_grpo\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "ImportError" in done.stderr and "free-threaded CPython" in done.stderr, done.stderr
