"""TRL's real ``AsyncGRPOTrainer`` trains from ``async_grpo.RolloutWorker`` on CPU.

A tiny random-weight Qwen3 model with the real Qwen3 tokenizer, the simulator as the vLLM
server, three optimizer steps. TRL 1.16 needs two functions replaced for CPU before the
trainer is built (its varlen flash-attention kernel is CUDA-only; its peak-FLOPs probe calls
CUDA), and a ``weight_transfer`` that needs no NCCL.
"""

from __future__ import annotations

import math
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import torch
import trl.experimental.async_grpo.async_grpo_trainer as trainer_module
import trl.experimental.async_grpo.packing as packing
from datasets import Dataset
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample as TrlSample

import async_grpo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "examples" / "trl-opencode"))
from conftest import RecordingQueue, cache_dir  # noqa: E402
from cpu import NoWeightTransfer, varlen_attention  # noqa: E402  # the CPU workarounds, shared with the example


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def reward(prompts: list[Any], completions: list[Any], answer: list[str], **columns: Any) -> list[float]:
    return [1.0 if a in c[-1]["content"] else 0.0 for c, a in zip(completions, answer, strict=True)]


def test_trl_async_grpo_trainer_trains_from_the_worker(tmp_path: Path, monkeypatch: Any) -> None:
    tokenizer_dir = cache_dir() / "qwen3"
    model_dir = tmp_path / "tiny-qwen3"
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, model_dir / name)
    monkeypatch.setattr(packing, "_flash_attn", lambda: types.SimpleNamespace(flash_attn_varlen_func=varlen_attention))
    monkeypatch.setattr(trainer_module, "get_peak_flops_per_device", lambda *args, **kwargs: None)

    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {a + 2}?"}], "answer": str(2 * a + 2)} for a in range(8)]
    dataset = Dataset.from_list(rows)
    # A MoE router on the simulator: the samples carry routed experts and per-token versions,
    # which TRL's trainer must take as its own samples.
    sim = async_grpo.Simulator(
        str(tokenizer_dir), tool_rounds=1, answer_tokens=16, model="tiny-qwen3", routed_experts="2x2x8"
    )

    def calculator(expression: str) -> str:
        """Evaluates an arithmetic expression.

        Args:
            expression: Two integers and an operator, such as "3 + 4".
        """
        left, _, right = expression.split()
        return str(int(left) + int(right))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    worker = async_grpo.RolloutWorker(
        model_name="tiny-qwen3",
        dataset=dataset,
        reward_funcs=[reward],
        tools=[calculator],
        processing_class=tokenizer,
        vllm_server_url=sim.url,
        num_generations=4,
        max_inflight_tasks=16,
        max_tokens=48,
        max_staleness=2,
        in_flight="continue",
        routed_experts=True,
    )
    buffer = RecordingQueue()
    worker.rollout_buffer = buffer
    transfer = NoWeightTransfer()
    losses = Losses()
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        num_generations=4,
        max_completion_length=48,
        token_budget=2048,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=True,
        dataloader_num_workers=0,
        vllm_server_base_url=sim.url,
        heartbeat_stale_after_s=120.0,
        max_staleness=2,
    )
    trainer = AsyncGRPOTrainer(
        model=str(model_dir),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_worker=worker,
        # Wrapped: each weight sync pauses the worker first, as a user wanting exact
        # per-token versions runs it.
        weight_transfer=worker.weight_transfer(transfer),
        callbacks=[losses],
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    try:
        trainer.train()
    finally:
        worker.stop()
        transcript = sim.transcript()
        sim.stop()

    assert trainer.state.global_step == 3
    assert losses.losses and all(math.isfinite(loss) for loss in losses.losses), losses.losses
    changed = [name for name, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert changed, "no weight changed"
    assert transfer.sends >= 1
    # Every sample the trainer consumed came from the worker, as TRL's own RolloutSample,
    # and holds ids the simulator sampled.
    assert buffer.taken, "the trainer consumed nothing"
    put = {id(s) for s in buffer.put_samples}
    assert all(id(s) in put for s in buffer.taken)
    assert all(isinstance(s, TrlSample) for s in buffer.taken)
    for sample in buffer.taken:
        assert sample.token_versions.shape[1] == 3
        assert sample.routed_experts.shape == (len(sample.input_ids), 2, 2)
    sampled = {tuple(prompt + answer) for prompt, answer, _, _ in transcript}
    assert all(tuple(s.input_ids.tolist()) in sampled for s in buffer.taken)
    assert worker.report["error"] is None
