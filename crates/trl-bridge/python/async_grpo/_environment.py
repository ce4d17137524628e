"""Environments (``environment=``): objects of OpenEnv's session-factory shape, which the
engine drives white-box (it samples every turn; the session runs the tools and verifies).

The shape, as OpenEnv's harness defines it (``ResourceSessionFactory``, ``ResourceSession``)::

    factory.create(task, seed=None, episode_id=None) -> session
    session.initial_messages() -> list[dict]          # optional; before the row's prompt
    session.list_tools() -> list[Tool | dict]          # MCP tools or OpenAI function dicts
    session.call_tool(name, arguments) -> ToolResult   # data, done, error, metadata
    session.verify(transcript, final_state=None) -> VerifyResult  # env_reward, done, metrics, artifacts
    session.close() -> None

``task`` is the dataset row (a dict: ``prompt`` and every other column). Any of these may be
``async def``: what it returns is awaited on the worker's asyncio loop. A ``call_tool`` may
also return a plain value (the tool's output) and ``verify`` a number or ``None`` (the
reward; ``None`` is unscorable). The engine calls all of them from its tool pool's threads,
never from the trainer's thread or its own runtime.

``Sessions`` does the calling for the engine and answers ``(ok, payload)``: on success the
payload is JSON the engine reads, on failure the message the model (or the log) reads.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
from typing import Any

logger = logging.getLogger("async_grpo")


def check_factory(environment: Any) -> str:
    """The environment's name, or ``TypeError`` when it does not have the factory's shape."""
    create = getattr(environment, "create", None)
    if not callable(create):
        raise TypeError(
            "environment must have OpenEnv's session-factory shape: a create(task, seed=None, "
            f"episode_id=None) method returning a session; got {type(environment).__name__}"
        )
    return type(environment).__name__


def _plain(value: Any) -> Any:
    """Pydantic models and dataclass-like objects as plain data."""
    if hasattr(value, "model_dump"):
        return value.model_dump()
    return value


def _field(value: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that ``value`` has, as a key of a dict or an attribute."""
    for name in names:
        if isinstance(value, dict):
            if name in value:
                return value[name]
        elif hasattr(value, name):
            return getattr(value, name)
    return default


def _tool(tool: Any, index: int) -> dict[str, Any]:
    """A listed tool as ``{name, description, parameters}``: an MCP ``Tool`` (``input_schema``
    or ``inputSchema``), a dict of that shape, or OpenAI's ``{"type": "function", "function":
    {...}}``."""
    tool = _plain(tool)
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
        tool = tool["function"]
    name = _field(tool, "name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"list_tools()[{index}] has no name: {tool!r}")
    parameters = _plain(_field(tool, "parameters", "input_schema", "inputSchema"))
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ValueError(f"list_tools()[{index}] ({name}): the parameters are not a JSON schema: {parameters!r}")
    return {"name": name, "description": str(_field(tool, "description") or ""), "parameters": parameters}


def _message(message: Any, index: int) -> dict[str, Any]:
    message = _plain(message)
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"initial_messages()[{index}] is not a message with a role: {message!r}")
    return message


def _call_result(result: Any) -> dict[str, Any]:
    """OpenEnv's ``ToolResult`` (or an object or dict with ``data`` and ``done``) read as
    such; anything else is the tool's output itself."""
    result = _plain(result)
    shaped = all(_field(result, key, default=_MISSING) is not _MISSING for key in ("data", "done"))
    if not shaped:
        return {"content": _content(result), "done": False, "error": None, "metadata": {}}
    error = _field(result, "error")
    metadata = _field(result, "metadata") or {}
    return {
        "content": _content(_field(result, "data")),
        "done": bool(_field(result, "done")),
        "error": None if error is None else str(error),
        "metadata": json.loads(json.dumps(dict(metadata), default=str)),
    }


_MISSING = object()


def _content(data: Any) -> Any:
    """What the model reads: text as is, ``None`` as nothing, else JSON-able data (the engine
    writes it as JSON), else ``str()``."""
    if data is None:
        return ""
    data = _plain(data)
    try:
        json.dumps(data)
    except (TypeError, ValueError):
        return str(data)
    return data


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _verify_result(result: Any) -> dict[str, Any]:
    """OpenEnv's ``VerifyResult`` (or a dict with ``env_reward``), or the reward itself (a
    number, or ``None``: unscorable)."""
    if result is None or isinstance(result, (int, float)):
        return {"env_reward": _number(result), "done": True, "metrics": {}}
    result = _plain(result)
    if _field(result, "env_reward", default=_MISSING) is _MISSING:
        raise TypeError(
            f"verify() must return a VerifyResult (env_reward, done, metrics), a number or None; got {result!r}"
        )
    metrics, other = {}, {}
    for key, value in dict(_field(result, "metrics") or {}).items():
        number = _number(value)
        if number is not None:
            metrics[str(key)] = number
        else:
            other[str(key)] = value
    # The rest is kept in the row's `environment.artifacts`: `artifacts`, and metrics that
    # are not numbers under `metrics`.
    artifacts = {str(key): value for key, value in dict(_plain(_field(result, "artifacts")) or {}).items()}
    if other:
        artifacts["metrics"] = other
    return {
        "env_reward": _number(_field(result, "env_reward")),
        "done": bool(_field(result, "done")),
        "metrics": metrics,
        "artifacts": json.loads(json.dumps(artifacts, default=str)),
    }


def _error(name: str, method: str, error: BaseException) -> str:
    logger.warning("environment %s: %s raised", name, method, exc_info=(type(error), error, error.__traceback__))
    return f"{type(error).__name__}: {error}"


class Sessions:
    """Calls an environment's factory and sessions for the engine; awaitables are awaited on
    ``loop`` (the worker's asyncio loop thread), this thread waiting without the GIL."""

    def __init__(self, loop: Any) -> None:
        self._loop = loop

    def _resolve(self, value: Any) -> Any:
        return self._loop.run(value) if inspect.isawaitable(value) else value

    def create(self, factory: Any, name: str, row_json: str, seed: int, episode_id: str) -> tuple[bool, Any]:
        session = None
        try:
            session = self._resolve(factory.create(json.loads(row_json), seed=seed, episode_id=episode_id))
            initial = getattr(session, "initial_messages", None)
            messages = [_message(m, i) for i, m in enumerate(self._resolve(initial()) if initial else [])]
            tools = [_tool(t, i) for i, t in enumerate(self._resolve(session.list_tools()))]
            return True, (session, json.dumps(messages, default=str), json.dumps(tools))
        except Exception as error:
            if session is not None:
                self.close(session, name)
            return False, _error(name, "create", error)

    def call_tool(self, session: Any, name: str, tool: str, arguments_json: str) -> tuple[bool, str]:
        try:
            result = self._resolve(session.call_tool(tool, json.loads(arguments_json)))
            return True, json.dumps(_call_result(result))
        except Exception as error:
            return False, _error(name, f"call_tool({tool})", error)

    def verify(self, session: Any, name: str, transcript_json: str) -> tuple[bool, str]:
        try:
            return True, json.dumps(_verify_result(self._resolve(session.verify(json.loads(transcript_json)))))
        except Exception as error:
            return False, _error(name, "verify", error)

    def close(self, session: Any, name: str) -> tuple[bool, str]:
        try:
            self._resolve(session.close())
            return True, ""
        except Exception as error:
            return False, _error(name, "close", error)
