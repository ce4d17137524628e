"""Python reward functions in TRL's signature: sync and async, weights, None as unscorable."""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import numpy as np
import pytest

from conftest import take

SEEN: list[dict[str, Any]] = []


def by_index(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **columns: Any) -> list[float]:
    SEEN.append({"prompts": prompts, "completions": completions, "ids": completion_ids, **columns})
    return [float(i) for i in range(len(completions))]


async def never_sure(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
    await asyncio.sleep(0.01)
    assert threading.current_thread().name == "async-grpo-asyncio"
    return [None for _ in completions]


class Halves:
    """A callable object whose __call__ is async."""

    async def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        return [0.5 if i % 2 else None for i in range(len(completions))]


def test_sync_async_and_none_rewards_are_weighted_as_trl_does(simulator, make_worker) -> None:
    SEEN.clear()
    sim = simulator()
    worker = make_worker(
        sim,
        dataset=[{"prompt": "What is 2 + 3?", "answer": "5"}],
        reward_funcs=[by_index, never_sure, Halves()],
        reward_weights=[2.0, 1.0, 10.0],
        epochs=1,
        python_processes=0,  # by_index records what it was given in this process's SEEN
    )
    assert worker.reward_func_names == ["by_index", "never_sure", "Halves"]
    worker.start()
    samples = sorted(take(worker, 4), key=lambda s: s.metrics["rewards/by_index"])
    [seen] = SEEN
    assert seen["prompts"] == [[{"role": "user", "content": "What is 2 + 3?"}]] * 4
    assert seen["answer"] == ["5"] * 4
    assert [c[-1]["role"] for c in seen["completions"]] == ["assistant"] * 4
    assert all(ids and isinstance(ids[0], int) for ids in seen["ids"])
    # Per completion i: 2*i from by_index, nothing from never_sure, 10*0.5 on odd i.
    rewards = np.array([2.0 * i + (5.0 if i % 2 else 0.0) for i in range(4)])
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
    assert [s.metrics["reward"] for s in samples] == list(rewards)
    np.testing.assert_allclose([s.advantage for s in samples], expected, rtol=1e-6)
    assert all(math.isnan(s.metrics["rewards/never_sure"]) for s in samples)
    assert [s.metrics["rewards/Halves"] for s in samples][1::2] == [0.5, 0.5]


def test_a_completion_no_reward_can_score_gets_advantage_zero(simulator, make_worker) -> None:
    sim = simulator()
    worker = make_worker(sim, reward_funcs=[never_sure], dataset=[{"prompt": "What is 2 + 3?"}], epochs=1)
    worker.start()
    samples = take(worker, 4)
    assert all(s.advantage == 0.0 and math.isnan(s.metrics["reward"]) for s in samples)


def test_a_raising_reward_leaves_its_column_unscored_and_the_run_goes_on(simulator, make_worker) -> None:
    def flaky(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        raise RuntimeError("judge unavailable")

    def wrong_length(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        return [1.0]

    sim = simulator()
    worker = make_worker(sim, reward_funcs=[flaky, wrong_length, by_index], dataset=[{"prompt": "What is 2 + 3?"}])
    worker.start()
    samples = take(worker, 8)
    assert all(math.isnan(s.metrics["rewards/flaky"]) for s in samples)
    assert all(math.isnan(s.metrics["rewards/wrong_length"]) for s in samples)
    assert sorted(s.metrics["rewards/by_index"] for s in samples[:4]) == [0.0, 1.0, 2.0, 3.0]
    worker.check_health(60.0)


def test_rewards_given_by_name_run_in_the_engine_beside_python_ones(simulator, make_worker) -> None:
    # The simulator is also the judge and the reward service: a completion scores 1 when its
    # text holds the row's answer. Every answer starts "The answer is", none holds "zebra".
    sim = simulator()
    judge = {
        "kind": "judge",
        "url": f"{sim.url}/judge/json/v1/chat/completions",
        "model": "judge",
        "score": "json",
        "template": "Reference: <answer>{answer}</answer>\nResponse: <completion>{completion}</completion>",
    }
    worker = make_worker(
        sim,
        dataset=[{"prompt": "Say anything.", "answer": "answer is"}, {"prompt": "Say more.", "answer": "zebra"}],
        reward_funcs=[
            "exact:answer",
            by_index,
            judge,
            {"kind": "http", "url": f"{sim.url}/reward", "name": "service"},
            # The simulator as a reward model: a conversation scores its message count plus its
            # last message's characters / 1000, raw (no activation asked).
            {"kind": "reward_model", "url": f"{sim.url}/classify", "model": "sim", "name": "rm"},
        ],
        reward_weights=[1.0, 0.0, 2.0, 4.0, 0.0],
        epochs=1,
        python_processes=0,
    )
    assert worker.reward_func_names == ["exact_answer", "by_index", "judge", "service", "rm"]
    worker.start()
    samples = take(worker, 8)
    for sample in samples:
        expected = 1.0 if sample.prompt[-1]["content"] == "Say anything." else 0.0
        assert sample.metrics["rewards/judge"] == expected, sample
        assert sample.metrics["rewards/service"] == expected, sample
        conversation = sample.prompt + sample.completion
        raw = len(conversation) + len(conversation[-1]["content"]) / 1000
        assert abs(sample.metrics["rewards/rm"] - raw) < 1e-9, sample
        assert sample.metrics["rewards/exact_answer"] == 0.0, sample
        # by_index's weight is 0; the judge's 2 and the service's 4 come from reward_weights.
        assert sample.metrics["reward"] == 6.0 * expected, sample


def test_a_reward_table_the_engine_cannot_build_is_refused_at_construction(simulator, make_worker) -> None:
    sim = simulator()
    for funcs, expected in [
        (["fuzzy:answer"], "reward_funcs[0]: invalid reward spec \"fuzzy:answer\": unknown kind 'fuzzy'"),
        ([by_index, {"kind": "judge", "url": sim.url, "model": "m"}], "reward_funcs[1]: kind \"judge\" needs `template`"),
        ([{"kind": "http", "url": sim.url, "colour": "red"}], "reward_funcs[0]: unknown field `colour`"),
        ([42], "reward_funcs[0] is not callable, a spec string or a reward table: 42"),
    ]:
        with pytest.raises((ValueError, TypeError)) as raised:
            make_worker(sim, reward_funcs=funcs)
        assert expected in str(raised.value), str(raised.value)
