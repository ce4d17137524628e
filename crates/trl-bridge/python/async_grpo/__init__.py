"""The async-grpo rollout engine (Rust) as a rollout worker for TRL's ``AsyncGRPOTrainer``.

``RolloutWorker`` implements TRL's rollout worker protocol (``rollout_buffer``,
``metrics_queue``, ``start``, ``stop``, ``update_model_version``, ``check_health``) on top of
the engine: rollouts, tool calls and scoring run on the engine's own threads, Python tools
and reward functions (sync or ``async def``) are called from there, and scored samples land
in ``rollout_buffer`` as TRL's own ``RolloutSample``. ``Simulator`` serves a GPU-free
vLLM-compatible stand-in to try it against. ``RowStream`` reads the rows an engine serves
over the network (``--serve-rows``), for any other trainer.
"""

from __future__ import annotations

import sysconfig

if sysconfig.get_config_var("Py_GIL_DISABLED"):
    raise ImportError(
        "async_grpo is built for CPython's stable ABI (3.10+), which free-threaded CPython "
        "(3.13t, 3.14t) cannot load; use a standard CPython build (with the GIL). The engine "
        "itself never needs the GIL: only calls into your tools and rewards take it."
    )

from typing import TYPE_CHECKING, Any

from ._native import Simulator, __version__

if TYPE_CHECKING:
    from ._sample import RolloutSample
    from ._stream import RowStream, StreamedGroup
    from ._worker import RolloutWorker

__all__ = ["RolloutSample", "RolloutWorker", "RowStream", "Simulator", "StreamedGroup", "__version__"]


def __getattr__(name: str) -> Any:
    """``RolloutWorker`` and ``RolloutSample`` on first use: finding TRL's ``RolloutSample``
    may import TRL and torch, which the worker processes of tools and rewards (they import
    ``async_grpo._pool``) must not pay for."""
    if name == "RolloutWorker":
        from ._worker import RolloutWorker

        return RolloutWorker
    if name == "RolloutSample":
        from ._sample import RolloutSample

        return RolloutSample
    if name in ("RowStream", "StreamedGroup"):
        from . import _stream

        return getattr(_stream, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
