"""Off-policy rows through the worker: a trainer's weight transfer wrapped by
``worker.weight_transfer`` pauses the worker in ``continue`` mode, so that every token of every
sample carries the version of the weights that sampled it; routing replay gives each sample
its experts as a NumPy array; the per-token bound masks."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from conftest import take, wait_until


class FakeTransfer:
    """A trainer's weight transfer whose send loads the next weights into the simulator."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.calls: list[str] = []
        self.version = 0

    def pause(self) -> None:
        self.calls.append("pause")

    def send_weights(self, iterator: Any) -> None:
        self.version += 1
        self.sim.set_weights(self.version)
        self.calls.append("send")

    def resume(self) -> None:
        self.calls.append("resume")


def sampled_positions(sample: Any) -> np.ndarray:
    covered = np.zeros_like(sample.input_ids)
    for start, end, _ in sample.token_versions:
        covered[start:end] += 1
    return covered


def test_a_wrapped_weight_transfer_keeps_each_token_s_version_exact_across_updates(simulator, make_worker) -> None:
    sim = simulator(tool_rounds=0, answer_tokens=30, per_token="4ms", routed_experts="2x2x8")
    worker = make_worker(sim, in_flight="continue", routed_experts=True, num_generations=2, max_inflight_tasks=4)
    transfer = worker.weight_transfer(FakeTransfer(sim))
    worker.start()
    samples: list[Any] = []
    for version in (1, 2):
        wait_until(lambda: sim.completions() >= 4 * version, 30.0, "answers sampled")
        time.sleep(0.05)  # part-way through the next answers (120 ms each)
        # What TRL's trainer does at a weight sync, in its order.
        transfer.pause()
        transfer.send_weights(iter(()))
        transfer.resume()
        worker.update_model_version(version)
    samples = take(worker, 16)
    assert transfer.calls == ["pause", "send", "resume"] * 2
    stats = worker.stats()
    assert stats.get("answers_continued", 0) > 0, stats
    assert all(not changed for _, changed in sim.weights()), "weights changed under a request"
    versions = {int(v) for s in samples for v in s.token_versions[:, 2]}
    assert versions >= {0, 1}, versions
    for sample in samples:
        assert (sampled_positions(sample) == sample.completion_mask).all()
        assert sample.model_version == sample.token_versions[:, 2].min()
        experts = sample.routed_experts
        assert experts.dtype == np.uint8 and experts.shape == (len(sample.input_ids), 2, 2)
        assert int(experts.max()) < 8
        assert sample.routed_experts_missing.tolist() == [[len(sample.input_ids) - 1, len(sample.input_ids)]]
    assert any(len(set(s.token_versions[:, 2].tolist())) > 1 for s in samples), "no sample spans an update"


def test_tokens_behind_the_per_token_bound_are_masked(simulator, make_worker) -> None:
    sim = simulator(tool_rounds=0, answer_tokens=30, per_token="4ms")
    worker = make_worker(
        sim, in_flight="continue", max_token_staleness=0, num_generations=2, max_inflight_tasks=4, epochs=1
    )
    transfer = worker.weight_transfer(FakeTransfer(sim))
    worker.start()
    wait_until(lambda: sim.completions() >= 2, 30.0, "answers sampled")
    time.sleep(0.05)
    transfer.pause()
    transfer.send_weights(iter(()))
    transfer.resume()
    worker.update_model_version(1)
    # The one pass over the 8 rows done: every group scored.
    wait_until(lambda: worker.stats().get("groups_completed", 0) >= 8, 30.0, "every group")
    stats = worker.stats()
    worker.stop()
    samples = []
    while not worker.rollout_buffer.empty():
        samples.append(worker.rollout_buffer.get())
    # A group complete after the update: its version-0 tokens are one behind, masked (a sample
    # left with none dropped). One complete before it: nothing was behind yet.
    after = [s for s in samples if 1 in s.token_versions[:, 2]]
    assert after, "no sample was completed after the update"
    for sample in samples:
        for start, end, version in sample.token_versions:
            expected = 0 if version == 0 and any(sample is a for a in after) else 1
            assert (sample.completion_mask[start:end] == expected).all(), sample.token_versions
    assert stats.get("tokens_offpolicy_masked", 0) > 0, stats


def test_off_policy_settings_are_checked_by_name(simulator, make_worker) -> None:
    sim = simulator()
    with pytest.raises(ValueError, match="in_flight must be one of 'wait', 'abort', 'continue'"):
        make_worker(sim, in_flight="keep")
    with pytest.raises(ValueError, match="stale_tokens must be one of 'mask', 'drop'"):
        make_worker(sim, stale_tokens="zero")
