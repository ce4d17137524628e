"""``RolloutSample``: TRL's own class when TRL is installed, an identical dataclass otherwise.

Where TRL keeps it, first match wins:

1. TRL's stable API: a TRL that exports ``AsyncGRPOTrainer`` from ``trl`` itself (how TRL
   promotes a trainer out of ``trl.experimental``, as it did KTO's: ``from trl import
   KTOTrainer``) gives the ``RolloutSample`` its trainer's module trains on; nothing is
   imported from ``trl.experimental`` then.
2. TRL 1.16: ``trl.experimental.async_grpo.async_rollout_worker.RolloutSample``.
3. Neither: ``_RolloutSample`` below.

Importing ``trl.experimental`` makes TRL warn (``TRLExperimentalWarning``, unless
``TRL_EXPERIMENTAL_SILENCE`` is set); the lookup ignores that one warning inside
``warnings.catch_warnings()``, so importing ``async_grpo`` prints nothing of TRL's and the
caller's warning filters and environment are as they were.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def _without_experimental_warning() -> Iterator[None]:
    """TRL's warning on importing ``trl.experimental`` ignored, every other warning as it was."""
    with warnings.catch_warnings():
        # TRL 1.16's words, for a TRL that has them but not the class.
        warnings.filterwarnings("ignore", message=r"You are importing from 'trl\.experimental'")
        try:
            from trl.import_utils import TRLExperimentalWarning
        except ImportError:
            pass
        else:
            warnings.filterwarnings("ignore", category=TRLExperimentalWarning)
        yield


def _stable_trl_sample() -> type | None:
    """The ``RolloutSample`` of the trainer ``trl`` exports, if it exports one."""
    import trl

    try:
        trainer = trl.AsyncGRPOTrainer
    except (AttributeError, ImportError, RuntimeError):
        # AttributeError: not exported (TRL 1.16). RuntimeError: TRL's lazy module wraps a
        # failed import of the trainer's module in one.
        return None
    module = importlib.import_module(trainer.__module__)
    sample = getattr(module, "RolloutSample", None)
    return sample if isinstance(sample, type) else None


def _experimental_trl_sample() -> type | None:
    """TRL 1.16's ``RolloutSample``."""
    try:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample as TrlSample
    except ImportError:
        return None
    return TrlSample


def _trl_sample() -> type | None:
    if importlib.util.find_spec("trl") is None:
        return None
    with _without_experimental_warning():
        return _stable_trl_sample() or _experimental_trl_sample()


RolloutSample: type = _trl_sample() or _RolloutSample
