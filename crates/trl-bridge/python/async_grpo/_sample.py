"""``RolloutSample``: TRL's own class when TRL is installed, an identical dataclass otherwise."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(slots=True)
class _RolloutSample:
    """One training row, as TRL's ``AsyncGRPOTrainer`` consumes it (same fields as TRL's)."""

    prompt: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    input_ids: np.ndarray
    completion_mask: np.ndarray
    old_log_probs: np.ndarray
    advantage: float
    model_version: int
    group_id: int
    metrics: dict[str, float]
    enqueued_at: float | None = None


def _trl_sample() -> type | None:
    if importlib.util.find_spec("trl") is None:
        return None
    try:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample as TrlSample
    except ImportError:
        return None
    return TrlSample


RolloutSample: type = _trl_sample() or _RolloutSample
