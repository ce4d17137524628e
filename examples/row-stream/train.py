"""A plain PyTorch training loop fed live by an engine's row stream, in a process (or on a
machine) of its own: no TRL, no Ray, nothing shared with the engine but the connection.

    async-grpo rollout --config examples/quickstart.toml --serve-rows 127.0.0.1:7000 --groups 64
    python examples/row-stream/train.py grpc://127.0.0.1:7000

Each group of rows arrives as an Arrow record batch as soon as it is scored; the loop takes
one optimizer step on it with GRPO's clipped objective (the rows carry the sampling policy's
logprobs and each completion's advantage), then acknowledges it: a group the trainer did not
acknowledge (it crashed mid-step) is served again to the next reader. Every
``--version-every`` steps the trainer does what a weight update does: it pauses the engine's
admission, moves its model version (the engine stamps the turns it samples from then on with
it) and resumes. The policy is a deliberately tiny stand-in (token embeddings and a linear
head), so the loop runs on CPU in seconds: what it shows is the wiring, and how each column is
read without a copy.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np
import torch

from async_grpo import RowStream


class TinyPolicy(torch.nn.Module):
    """Next-token logits from each token's embedding alone: small enough for any CPU."""

    def __init__(self, vocab: int, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))  # type: ignore[no-any-return]


def padded(column: Any, dtype: Any) -> np.ndarray:
    """A list column (one list per row) as a rows x longest array, zero-padded. The values
    are read from the Arrow buffer without a copy; only the padding copies."""
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy()  # zero_copy_only: raises rather than copy
    out = np.zeros((len(column), int(np.diff(offsets).max())), dtype=dtype)
    for row in range(len(column)):
        start, end = offsets[row], offsets[row + 1]
        out[row, : end - start] = values[start:end]
    return out


def grpo_loss(policy: TinyPolicy, rows: Any, clip: float) -> torch.Tensor:
    """GRPO's clipped surrogate on one group: per token, the ratio of the policy's
    probability of the sampled token to the sampler's, times the completion's advantage,
    averaged over the completion tokens (``completion_mask``)."""
    ids = torch.from_numpy(padded(rows.column("input_ids"), np.int64))
    mask = torch.from_numpy(padded(rows.column("completion_mask"), np.float32))
    old = torch.from_numpy(padded(rows.column("old_log_probs"), np.float32))
    advantage = torch.from_numpy(rows.column("advantage").to_numpy()).float()[:, None]
    # Token t is predicted from token t - 1.
    logits = policy(ids[:, :-1])
    new = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask, old = mask[:, 1:], old[:, 1:]
    ratio = torch.exp(new - old)
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
    return -(surrogate * mask).sum() / mask.sum().clamp(min=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the engine's row stream: grpc://HOST:PORT or grpc+tls://HOST:PORT")
    parser.add_argument("--token", help="the stream's bearer token (--serve-rows-token)")
    parser.add_argument("--ca", help="a PEM file of certificates to trust for TLS")
    parser.add_argument("--vocab", type=int, default=151_936, help="the tokenizer's vocabulary size")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--version-every", type=int, default=4, help="steps between weight updates")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    policy = TinyPolicy(args.vocab)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    version = 0
    with RowStream(args.url, token=args.token, ca=args.ca) as stream:
        for step, group in enumerate(stream, start=1):
            loss = grpo_loss(policy, group.rows, args.clip)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            # Trained on: the group is the trainer's now.
            stream.ack(group)
            sampled = group.rows.column("model_version").to_numpy()
            print(
                json.dumps(
                    {
                        "step": step,
                        "position": group.position,
                        "rows": group.rows.num_rows,
                        "loss": float(loss),
                        "sampled_by": int(sampled.max()),
                    }
                ),
                flush=True,
            )
            if not math.isfinite(float(loss)):
                raise SystemExit(f"step {step}: the loss is {float(loss)}")
            if step % args.version_every == 0:
                # A weight update: admission stops, in-flight rollouts finish under the old
                # weights, the new version is posted, admission resumes.
                stream.pause("wait")
                version += 1
                stream.update_model_version(version)
                stream.resume()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
