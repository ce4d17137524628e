"""Tools and reward functions: names, JSON schemas, sync or async, and how the engine calls them.

The engine (Rust) decides where a call runs; ``Bridge`` does the calling and turns whatever
the user's function returns or raises into ``(ok, text)``:

- sync functions are called by ``run_tool`` / ``run_reward``: in a worker process
  (``async_grpo._pool``) by default, or, for one that cannot be pickled, through
  ``Bridge.call_tool`` / ``Bridge.call_reward`` on the engine's pool threads, which hold the
  GIL only while Python runs;
- ``async def`` functions run on the worker's asyncio loop thread (``LoopThread``): the engine
  puts each call in the loop's inbox (``_native.Inbox``) without the GIL, the loop takes
  them, runs ``Bridge.coroutine`` for each as a task, and reports through the call's callback.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import inspect
import json
import logging
import math
import re
import threading
import types
import typing
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from . import _native
from ._environment import Sessions

logger = logging.getLogger("async_grpo")

Done = Callable[[bool, str], None]


def returns_awaitable(function: Callable[..., Any]) -> bool:
    """Whether calling ``function`` returns an awaitable, judged from what runs when it is
    called: through ``functools.partial``, bound methods, and a callable object's ``__call__``
    (an instance whose ``__call__`` is ``async def`` counts), not from the object alone."""
    while isinstance(function, functools.partial):
        function = function.func
    if inspect.iscoroutinefunction(function):
        return True
    if inspect.isfunction(function) or inspect.ismethod(function) or inspect.isbuiltin(function):
        return False
    call = getattr(type(function), "__call__", None)
    return call is not None and inspect.iscoroutinefunction(call)


def callable_name(function: Callable[..., Any]) -> str:
    """TRL's name for a callable: a ``name`` attribute, else ``__name__`` (through partials),
    else the class name of a callable object."""
    name = getattr(function, "name", None)
    if isinstance(name, str) and name:
        return name
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__name__", type(function).__name__)


def _signature_target(function: Callable[..., Any]) -> Callable[..., Any]:
    """What to read a signature, type hints and docstring from: the function itself, or a
    callable object's bound ``__call__``."""
    if inspect.isfunction(function) or inspect.ismethod(function):
        return function
    call: Callable[..., Any] = getattr(function, "__call__")  # noqa: B004
    return call


# What ``transformers.utils.get_json_schema`` (transformers 5.x, ``chat_template_utils.py``)
# writes for each type hint and docstring, kept here for when transformers is not installed:
# the same schema, key for key and in the same order, since a template renders it into the
# prompt. Where transformers refuses a tool (a hint it cannot map, an argument without a
# description), this builder still gives a schema: {} for the hint, no description.

# The Python types a JSON value can be, by their JSON schema type.
_JSON_SCALARS: dict[type, str] = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_JSON_TYPES: dict[Any, dict[str, Any]] = {
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    list: {"type": "array"},
    tuple: {"type": "array"},
    dict: {"type": "object"},
    Any: {},
}


def _enum_schema(values: list[Any]) -> dict[str, Any]:
    """An ``enum`` of JSON scalars, typed by each JSON type among them, in order of first use."""
    kinds = list(dict.fromkeys(_JSON_SCALARS.get(type(value), "string") for value in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _json_type(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [member.value for member in hint]
        return _enum_schema(values) if values else {}
    if origin is None:
        return dict(_JSON_TYPES.get(hint, {}))
    if origin in (typing.Union, types.UnionType):
        options = [_json_type(arg) for arg in args if arg is not type(None)]
        if len(options) == 1:
            schema = options[0]
        elif all(o.keys() == {"type"} and isinstance(o["type"], str) for o in options):
            kinds = sorted({o["type"] for o in options})
            schema = {"type": kinds[0] if len(kinds) == 1 else kinds}
        else:
            schema = {"anyOf": options}
        if type(None) in args:
            schema["nullable"] = True
        return schema
    if origin is typing.Literal:
        return _enum_schema(list(args)) if args else {}
    if origin in (list, set, frozenset):
        return {"type": "array", "items": _json_type(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if args[-1] is Ellipsis:
            return {"type": "array", "items": _json_type(args[0])}
        return {"type": "array", "prefixItems": [_json_type(arg) for arg in args]}
    if origin is dict:
        schema = {"type": "object"}
        if len(args) == 2:
            schema["additionalProperties"] = _json_type(args[1])
        return schema
    return {}


# transformers' reading of a Google-style docstring: the description runs up to the first
# "Args:", "Returns:" or "Raises:" (its line breaks kept); an argument's description runs up to
# the next "name:" line that is not indented deeper, its lines joined by one space; a "(type)"
# after the name is skipped.
_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG = re.compile(
    r"(?:^|\n)([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*?)\s*"
    r"(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)",
    re.DOTALL,
)
# A description ending in "(choices: [...])" lists the argument's values.
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


def _docstring_parts(doc: str | None) -> tuple[str, dict[str, str]]:
    """A Google-style docstring's description and ``Args:`` descriptions, as transformers reads
    them."""
    if not doc:
        return "", {}
    doc = doc.strip()
    description = _DESCRIPTION.search(doc)
    block = _ARGS.search(doc)
    args: dict[str, str] = {}
    if block is not None:
        lines = "\n".join(line for line in block.group(1).split("\n") if line.strip())
        for _indent, name, text in _ARG.findall(lines):
            args[name] = re.sub(r"\s*\n+\s*", " ", text.strip())
    return (description.group(1).strip() if description else ""), args


def _described(schema: dict[str, Any], text: str) -> dict[str, Any]:
    """``schema`` with an argument's description, and its ``(choices: [...])`` as an enum."""
    choices = _CHOICES.search(text)
    if choices:
        try:
            values = json.loads(choices.group(1))
        except ValueError:
            values = None
        if isinstance(values, list):
            schema["enum"] = [v.strip() if isinstance(v, str) else v for v in values]
            text = text[: choices.start()].strip()
    schema["description"] = text
    return schema


def _bound_by_partials(function: Callable[..., Any]) -> tuple[Callable[..., Any], set[str]]:
    """The function under any ``functools.partial``s, and the keywords they bind (not the
    model's to give)."""
    bound: set[str] = set()
    while isinstance(function, functools.partial):
        bound |= set(function.keywords)
        function = function.func
    return function, bound


def _derived_schema(name: str, function: Callable[..., Any]) -> dict[str, Any]:
    """The schema from the signature, type hints and Google-style docstring, as
    ``transformers.utils.get_json_schema`` builds it, for when transformers is not installed."""
    target, bound = _bound_by_partials(function)
    target = _signature_target(target)
    signature = inspect.signature(function)
    try:
        hints = typing.get_type_hints(target)
    except Exception:
        hints = {}
    description, arg_docs = _docstring_parts(inspect.getdoc(target))
    properties: dict[str, Any] = {}
    required: list[str] = []
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or parameter.name in bound:
            continue
        schema = _json_type(hints.get(parameter.name, parameter.annotation))
        if parameter.name in arg_docs:
            schema = _described(schema, arg_docs[parameter.name])
        properties[parameter.name] = schema
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return {"name": name, "description": description, "parameters": parameters}


def _transformers_schema(name: str, function: Callable[..., Any]) -> dict[str, Any] | None:
    """``transformers.utils.get_json_schema``'s schema (what TRL renders), or None when
    transformers is not installed. A partial's bound arguments are left out."""
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        return None
    target, bound = _bound_by_partials(function)
    schema = get_json_schema(_signature_target(target))["function"]
    if bound or isinstance(function, functools.partial):
        remaining = set(inspect.signature(function).parameters)
        parameters = schema.get("parameters", {})
        props = parameters.get("properties", {})
        for key in list(props):
            if key not in remaining or key in bound:
                del props[key]
        if "required" in parameters:
            parameters["required"] = [r for r in parameters["required"] if r in props]
    schema["name"] = name
    return dict(schema)


@dataclass(frozen=True)
class ToolEntry:
    """A tool ready for the engine."""

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]
    is_async: bool


def tool_entry(item: Any, index: int) -> ToolEntry:
    """A tool from what ``tools=`` holds: a callable, or ``{"function": callable, "name": ...,
    "schema": {...}}`` with an explicit name and/or schema (OpenAI's function shape, bare or
    under ``{"type": "function", "function": ...}``)."""
    explicit_name: str | None = None
    schema: dict[str, Any] | None = None
    function = item
    if isinstance(item, dict):
        unknown = set(item) - {"function", "name", "schema"}
        if unknown:
            raise ValueError(f"tools[{index}]: unknown keys {sorted(unknown)}; expected function, name, schema")
        function = item.get("function")
        explicit_name = item.get("name")
        schema = item.get("schema")
        if schema is not None:
            if not isinstance(schema, dict):
                raise TypeError(f"tools[{index}]: schema must be a dict (a JSON schema), got {type(schema).__name__}")
            schema = dict(schema.get("function", schema))
    if not callable(function):
        raise TypeError(f"tools[{index}]: expected a callable or a dict with a callable 'function', got {item!r}")
    name = explicit_name or (schema or {}).get("name") or callable_name(function)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"tools[{index}]: the tool's name must be an identifier, got {name!r}")
    if schema is None:
        try:
            schema = _transformers_schema(name, function)
        except Exception as error:
            raise ValueError(
                f"tools[{index}] ({name}): transformers.utils.get_json_schema cannot describe it ({error}); "
                "document every argument in a Google-style docstring with type hints, or pass an explicit "
                "schema: {'function': f, 'schema': {...}}"
            ) from error
        if schema is None:
            schema = _derived_schema(name, function)
    parameters = schema.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ValueError(f"tools[{index}] ({name}): the schema's parameters must be a JSON schema of type object")
    return ToolEntry(
        name=name,
        description=str(schema.get("description") or ""),
        parameters=parameters,
        function=function,
        is_async=returns_awaitable(function),
    )


def _content(result: Any) -> str:
    """A tool's return value as the tool message's content: text as is, else JSON, else str()."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


def _error(kind: str, name: str, error: BaseException) -> str:
    logger.warning("%s %s raised", kind, name, exc_info=(type(error), error, error.__traceback__))
    return f"{type(error).__name__}: {error}"


def _awaitable_from_sync(kind: str, name: str, result: Any) -> str:
    if inspect.iscoroutine(result):
        result.close()
    return (
        f"{kind} {name!r} was registered as sync (calling it does not look async) but returned an awaitable; "
        "make it (or its __call__) an `async def`"
    )


def _reward_kwargs(group: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """TRL's reward-function arguments for a group: ``prompts``, ``completions``,
    ``completion_ids`` and every dataset column, one entry per completion."""
    completions = group["completions"]
    n = len(completions)
    kwargs: dict[str, Any] = {
        "prompts": [group["prompt"] for _ in range(n)],
        "completions": [c["messages"] for c in completions],
        "completion_ids": [c["token_ids"] for c in completions],
    }
    for column, value in group.get("row", {}).items():
        kwargs.setdefault(column, [value for _ in range(n)])
    return n, kwargs


def _scores_json(name: str, n: int, result: Any) -> tuple[bool, str]:
    if not isinstance(result, (list, tuple)) or len(result) != n:
        return False, f"reward function {name!r} must return a list of {n} floats or None, got {result!r}"
    scores: list[float | None] = []
    for value in result:
        if value is None:
            scores.append(None)
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            return False, f"reward function {name!r} returned {value!r}, not a float or None"
        scores.append(number if math.isfinite(number) else None)
    return True, json.dumps(scores)


def run_tool(function: Callable[..., Any], name: str, kwargs: dict[str, Any]) -> tuple[bool, str]:
    """Calls a sync tool with the model's arguments: ``(True, content)``, or ``(False,
    error)`` for what it raised. Here, or in a worker process (``async_grpo._pool``)."""
    try:
        result = function(**kwargs)
    except Exception as error:
        return False, _error("tool", name, error)
    if inspect.isawaitable(result):
        return False, _awaitable_from_sync("tool", name, result)
    return True, _content(result)


def run_reward(function: Callable[..., Any], name: str, group: dict[str, Any]) -> tuple[bool, str]:
    """Calls a sync reward function on a group: ``(True, scores as JSON)``, or ``(False,
    error)``. Here, or in a worker process (``async_grpo._pool``)."""
    n, kwargs = _reward_kwargs(group)
    try:
        result = function(**kwargs)
    except Exception as error:
        return False, _error("reward function", name, error)
    if inspect.isawaitable(result):
        return False, _awaitable_from_sync("reward function", name, result)
    return _scores_json(name, n, result)


class LoopThread:
    """The worker's asyncio event loop, on a thread of its own, where ``async def`` tools,
    rewards and agents run: the calls the engine puts in ``inbox``, each a task made by
    ``coroutine(kind, function, name, payload)`` (the ``Bridge``'s, set when it is made)."""

    def __init__(self, name: str = "async-grpo-asyncio") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.inbox = _native.Inbox()
        self.coroutine: Callable[[str, Any, str, str], Coroutine[Any, Any, tuple[bool, str]]] | None = None

    def start(self) -> None:
        ready = threading.Event()
        inbox = self.inbox

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            tasks: dict[int, asyncio.Task[tuple[bool, str]]] = {}
            loop.add_reader(inbox.fileno(), self._take, loop, tasks)
            inbox.open()
            ready.set()
            try:
                loop.run_forever()
            finally:
                # Calls still waiting are told the loop stopped; those running are cancelled.
                inbox.close()
                loop.remove_reader(inbox.fileno())
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                # Its executor's threads too (an HTTP client resolving a host starts them).
                loop.run_until_complete(loop.shutdown_default_executor())
                loop.close()

        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()
        ready.wait()

    def _take(self, loop: asyncio.AbstractEventLoop, tasks: dict[int, asyncio.Task[tuple[bool, str]]]) -> None:
        """Starts every call waiting in the inbox, and cancels those the engine gave up."""
        for entry in self.inbox.take():
            if entry[0] == "cancel":
                task = tasks.pop(entry[1], None)
                if task is not None:
                    task.cancel()
                continue
            _, key, kind, function, name, payload, done = entry
            try:
                if self.coroutine is None:
                    raise RuntimeError("this loop runs no calls")
                task = loop.create_task(self.coroutine(kind, function, name, payload))
            except Exception as error:
                done(False, repr(error))
                continue
            tasks[key] = task
            task.add_done_callback(functools.partial(_report, tasks, key, done))

    def run(self, awaitable: Any) -> Any:
        """Awaits ``awaitable`` on the loop and returns its result, this thread waiting (without
        the GIL). Never call it from the loop's own thread."""
        loop = self._loop
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run() called from the loop's own thread")
        if loop is None or loop.is_closed() or not loop.is_running():
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            raise RuntimeError("the worker's asyncio loop is not running")

        async def wait() -> Any:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(wait(), loop).result()

    def stop(self, timeout: float) -> bool:
        """Stops the loop (tasks still running are cancelled) and joins its thread."""
        loop, thread = self._loop, self._thread
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:
                pass
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True


def _report(
    tasks: dict[int, asyncio.Task[tuple[bool, str]]], key: int, done: Done, task: asyncio.Task[tuple[bool, str]]
) -> None:
    """A call's task ended: its answer to the engine."""
    tasks.pop(key, None)
    if task.cancelled():
        done(False, "cancelled")
    elif task.exception() is not None:
        done(False, repr(task.exception()))
    else:
        done(*task.result())


class Bridge:
    """What the engine calls to run a Python tool, reward function or environment session."""

    def __init__(self, loop: LoopThread) -> None:
        self._loop = loop
        self._sessions = Sessions(loop)
        loop.coroutine = self.coroutine
        # The engine hands ``async def`` calls to the loop through it (``_native.Inbox``).
        self.inbox = loop.inbox

    def coroutine(self, kind: str, function: Callable[..., Any], name: str, payload: str) -> Coroutine[Any, Any, tuple[bool, str]]:
        """The call the engine put in the loop's inbox, as a coroutine: a tool's (``kind``
        ``tool``, JSON keyword arguments), a reward function's (``reward``, the group as
        JSON) or an agent's (``agent``)."""
        if kind == "tool":
            return self._tool(function, name, payload)
        if kind == "reward":
            return self._reward(function, name, payload)
        if kind == "agent":
            from ._agent import run_agent_async

            return run_agent_async(function, name, payload)
        raise ValueError(f"no call of kind {kind!r}")

    def create_session(self, factory: Any, name: str, row_json: str, seed: int, episode_id: str) -> tuple[bool, Any]:
        return self._sessions.create(factory, name, row_json, seed, episode_id)

    def session_call_tool(self, session: Any, name: str, tool: str, arguments_json: str) -> tuple[bool, str]:
        return self._sessions.call_tool(session, name, tool, arguments_json)

    def session_verify(self, session: Any, name: str, transcript_json: str) -> tuple[bool, str]:
        return self._sessions.verify(session, name, transcript_json)

    def session_close(self, session: Any, name: str) -> tuple[bool, str]:
        return self._sessions.close(session, name)

    def call_tool(self, function: Callable[..., Any], name: str, kwargs_json: str) -> tuple[bool, str]:
        return run_tool(function, name, json.loads(kwargs_json))

    def call_agent(self, function: Callable[..., Any], name: str, payload_json: str) -> tuple[bool, str]:
        from ._agent import run_agent

        return run_agent(function, name, payload_json)

    async def _tool(self, function: Callable[..., Any], name: str, kwargs_json: str) -> tuple[bool, str]:
        try:
            result = function(**json.loads(kwargs_json))
            if inspect.isawaitable(result):
                result = await result
        except Exception as error:
            return False, _error("tool", name, error)
        return True, _content(result)

    def call_reward(self, function: Callable[..., Any], name: str, group_json: str) -> tuple[bool, str]:
        return run_reward(function, name, json.loads(group_json))

    async def _reward(self, function: Callable[..., Any], name: str, group_json: str) -> tuple[bool, str]:
        n, kwargs = _reward_kwargs(json.loads(group_json))
        try:
            result = function(**kwargs)
            if inspect.isawaitable(result):
                result = await result
        except Exception as error:
            return False, _error("reward function", name, error)
        return _scores_json(name, n, result)
