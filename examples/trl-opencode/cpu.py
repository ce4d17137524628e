"""What TRL 1.16's ``AsyncGRPOTrainer`` needs to train on a CPU: its varlen flash-attention
kernel is CUDA-only and its peak-FLOPs probe calls CUDA, so both are replaced before the
trainer is built; and a weight transfer that sends nothing, for a server that holds no
weights (the simulator) or a trainer that has no NCCL (a CPU).

    with cpu.on_cpu():
        trainer = AsyncGRPOTrainer(..., weight_transfer=cpu.NoWeightTransfer())
        trainer.train()
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
import trl.experimental.async_grpo.async_grpo_trainer as trainer_module
import trl.experimental.async_grpo.packing as packing


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    **_: Any,
) -> torch.Tensor:
    """flash_attn_varlen_func in plain torch: each packed segment attends to its own keys,
    causally aligned bottom-right (the segment's queries are its keys' last rows)."""
    repeat = query.shape[1] // key.shape[1]
    outputs = []
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        q = query[qs:qe].transpose(0, 1)
        k = key[ks:ke].repeat_interleave(repeat, dim=1).transpose(0, 1)
        v = value[ks:ke].repeat_interleave(repeat, dim=1).transpose(0, 1)
        if causal and qe - qs == ke - ks:
            # The mask below, without building it: a segment of an agent's rollout is
            # thousands of tokens long, its mask their square.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=softmax_scale)
        else:
            mask = None
            if causal:
                mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(diagonal=(ke - ks) - (qe - qs))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs, dim=0)


class NoWeightTransfer:
    """A weight transfer with nothing to send to: the trainer's weights reach no server."""

    def __init__(self) -> None:
        self.sends = 0

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Any) -> None:
        for _name, _tensor in iterator:
            pass
        self.sends += 1

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """TRL's CUDA-only attention kernel and FLOPs probe replaced while the block runs (build
    and train the trainer inside it), restored after."""
    saved = packing._flash_attn, trainer_module.get_peak_flops_per_device
    packing._flash_attn = lambda: types.SimpleNamespace(flash_attn_varlen_func=varlen_attention)
    trainer_module.get_peak_flops_per_device = lambda *args, **kwargs: None
    try:
        yield
    finally:
        packing._flash_attn, trainer_module.get_peak_flops_per_device = saved
