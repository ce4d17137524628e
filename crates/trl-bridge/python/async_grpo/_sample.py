"""``RolloutSample``: TRL's own class when TRL is installed, an identical dataclass otherwise.

Where TRL keeps it, first match wins:

1. TRL's stable API: a TRL that exports ``AsyncGRPOTrainer`` from ``trl`` itself (how TRL
   promotes a trainer out of ``trl.experimental``, as it did KTO's: ``from trl import
   KTOTrainer``) gives the ``RolloutSample`` its trainer's module trains on; nothing is
   imported from ``trl.experimental`` then.
2. TRL 1.16: ``trl.experimental.async_grpo.async_rollout_worker.RolloutSample``.
3. Neither: ``_RolloutSample`` below.

The class exported is a subclass of that one with what off-policy trainers read besides
(``token_versions``, ``routed_experts``, ``routed_experts_missing``; ``None`` where a field
does not apply), so TRL's trainer consumes it as its own.

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
from typing import Any, cast

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
    return cast(type, TrlSample)


def _trl_sample() -> type | None:
    if importlib.util.find_spec("trl") is None:
        return None
    with _without_experimental_warning():
        return _stable_trl_sample() or _experimental_trl_sample()


def _with_offpolicy_fields(base: type) -> type:
    """``base`` with the per-token fields of off-policy training added, each ``None`` unless set."""

    @dataclass(slots=True)
    class RolloutSample(base):  # type: ignore[misc]
        """One training row: TRL's fields, then per token the version of the weights that
        sampled it (``token_versions``: one ``[start, end, version]`` row per span of
        ``input_ids``, sampled tokens only) and, with routing replay, the experts the router
        chose (``routed_experts``: shape ``(len(input_ids), layers, top_k)``, uint8 or uint16;
        ``routed_experts_missing``: ``[start, end]`` rows of tokens the server reported no
        routing for, zeros in ``routed_experts``)."""

        token_versions: np.ndarray | None = None
        routed_experts: np.ndarray | None = None
        routed_experts_missing: np.ndarray | None = None

    RolloutSample.__module__ = __name__
    return RolloutSample


RolloutSample: type = _with_offpolicy_fields(_trl_sample() or _RolloutSample)
