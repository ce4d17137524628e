"""Loop-owning agents (``agent=``): each rollout is run by an agent that owns its loop and
talks to the worker's recording proxy (an OpenAI-compatible server on 127.0.0.1) while the
engine samples every turn it asks for, so the rows are exact whatever the agent does with the
text.

Two forms:

- a **program**: a mapping with the keys of the ``async-grpo rollout`` binary's ``[agent]``
  table (``command`` with ``{prompt}``/``{workdir}``/``{task_json}``, ``env``, ``workdir``,
  ``setup``, ``verify``, ``timeout``, ``command_timeout``, ``weight``, ``sandbox``,
  ``network``, ``limits``; durations as ``"10m"`` or seconds). The engine reads it as the
  binary does. Programs named by a relative path, and arguments naming a file in the current
  directory, are taken from the current directory. The programs run sandboxed, reaching only
  their proxy (through this package's forwarder, ``forwarder()``).
- a **callable**, sync or ``async def``::

      def agent(task, *, base_url, api_key, workdir, episode_id): ...

  called once per rollout attempt with the dataset row, the proxy's URL (``.../v1``) and the
  rollout's key (what an OpenAI client takes), and a fresh private directory removed after
  the call; it is given only the keywords it names (all of them if it takes ``**kwargs``).
  A number it returns is its reward; what it raises fails that attempt only.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ._callables import _error

_KEYWORDS = ("base_url", "api_key", "workdir", "episode_id")


def forwarder() -> list[str]:
    """The command line a sandboxed agent program runs under: this interpreter, finding this
    package where it is now, serving ``_native.agent_forward``."""
    package_parent = str(Path(__file__).resolve().parent.parent)
    code = (
        f"import sys; sys.path.insert(0, {package_parent!r}); "
        "from async_grpo._native import agent_forward; sys.exit(agent_forward(sys.argv[1:]))"
    )
    return [sys.executable, "-I", "-c", code]


def program_json(agent: Mapping[str, Any]) -> str:
    """The ``[agent]`` mapping as JSON for the engine, durations given as numbers of seconds
    written as the worker writes its own;
    ``TypeError`` for a value JSON cannot hold."""
    from ._worker import _duration  # the worker's module, loaded by then

    table = dict(agent)
    for key in ("timeout", "command_timeout"):
        value = table.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"agent: {key} must be longer than zero, got {value}")
            table[key] = _duration(value)
    try:
        return json.dumps(table)
    except (TypeError, ValueError) as error:
        raise TypeError(f"agent: the mapping cannot be written as JSON: {error}") from error


def check_agent(agent: Any) -> None:
    """``TypeError`` unless ``agent`` is a mapping or a callable."""
    if isinstance(agent, Mapping) or callable(agent):
        return
    raise TypeError(
        "agent must be a mapping with the keys of the binary's [agent] table (a program) or a "
        f"callable agent(task, *, base_url, api_key, workdir, episode_id); got {type(agent).__name__}"
    )


def _keywords(function: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The keywords of ``offered`` that ``function`` names (all of them with ``**kwargs``)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return offered
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return offered
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {key: value for key, value in offered.items() if key in named}


def _result(value: Any) -> str:
    """What the engine reads of the return value: a finite number is the reward."""
    reward = None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        reward = float(value)
    return json.dumps({"reward": reward})


def _arguments(function: Callable[..., Any], payload: dict[str, Any], workdir: str) -> tuple[Any, dict[str, Any]]:
    offered = {
        "base_url": payload["base_url"],
        "api_key": payload["api_key"],
        "workdir": workdir,
        "episode_id": payload["episode_id"],
    }
    return payload["task"], _keywords(function, offered)


def _workdir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="async-grpo-agent-")


def run_agent(function: Callable[..., Any], name: str, payload_json: str) -> tuple[bool, str]:
    """Runs a sync agent for one rollout attempt (on an engine thread): ``(True, result)``
    or ``(False, error)``."""
    payload = json.loads(payload_json)
    try:
        with _workdir() as workdir:
            task, kwargs = _arguments(function, payload, workdir)
            value = function(task, **kwargs)
            if inspect.isawaitable(value):
                if inspect.iscoroutine(value):
                    value.close()
                return False, f"agent {name!r} returned an awaitable but was taken as sync; make it an `async def`"
    except Exception as error:
        return False, _error("agent", name, error)
    return True, _result(value)


async def run_agent_async(function: Callable[..., Any], name: str, payload_json: str) -> tuple[bool, str]:
    """Runs an ``async def`` agent for one rollout attempt on the worker's loop; cancelled
    (its directory removed) when the attempt is dropped."""
    payload = json.loads(payload_json)
    try:
        with _workdir() as workdir:
            task, kwargs = _arguments(function, payload, workdir)
            value = function(task, **kwargs)
            if inspect.isawaitable(value):
                value = await value
    except asyncio.CancelledError:
        raise
    except Exception as error:
        return False, _error("agent", name, error)
    return True, _result(value)

