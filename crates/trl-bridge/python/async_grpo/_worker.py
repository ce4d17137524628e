"""``RolloutWorker``: TRL's rollout worker protocol on top of the Rust engine.

Threads (all started by ``start()``, all joined by ``stop()``):

- the engine's runtime threads (``async-grpo-rt``), its tool pool (``async-grpo-tool``) and
  reward pool (``async-grpo-reward``): Rust, holding the GIL only while a Python tool or
  reward function runs;
- ``async-grpo-asyncio``: the asyncio loop where ``async def`` tools and rewards run;
- ``async-grpo-pump``: moves scored groups from the engine into ``rollout_buffer`` as
  ``RolloutSample``s and pushes metrics (with ``serve_rows``: writes them to the output and
  pushes them to the row stream, all in Rust); it waits on the engine without the GIL;
- ``async-grpo-pool-N``: one per worker process of sync tools and rewards
  (``python_processes``, ``async_grpo._pool``), reading its answers; the processes
  themselves are killed by ``stop()``.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import _native
from ._callables import Bridge, LoopThread, callable_name, returns_awaitable, tool_entry
from ._agent import check_agent, forwarder, program_json
from ._environment import check_factory
from ._pool import init_frame, placement
from ._sample import RolloutSample
from ._tokenizer import tokenizer_source

logger = logging.getLogger("async_grpo")

MetricValue = float | tuple[float, float]

# Engine counters pushed to `metrics_queue` as deltas (TRL sums keys with a `total` word).
_COUNTERS = {
    "rollouts_completed": "rollout/completed_total",
    "rollouts_failed": "rollout/failed_total",
    "rollouts_retried": "rollout/retried_total",
    "rollouts_cancelled": "rollout/cancelled_total",
    "groups_stale": "rollout/stale_groups_total",
    "groups_too_small": "rollout/dropped_groups_total",
    "turns": "rollout/turns_total",
    "sampled_tokens": "rollout/sampled_tokens_total",
    "tool_calls": "tools/call_total",
    "tool_errors": "tools/failure_total",
    "parse_failures": "tools/parse_failure_total",
    "server_retries": "rollout/vllm_retry_total",
    "tools/unknown_name": "tools/unknown_name_total",
}


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def _number(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number) or number < low or number > high or (low_open and number == low):
        bound = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bound}{low}, {high}], got {value}")
    return number


def _servers(url: Any) -> list[str]:
    urls = [url] if isinstance(url, str) else url
    if not isinstance(urls, (list, tuple)) or not urls:
        raise TypeError("vllm_server_url must be a URL or a non-empty list of URLs")
    for u in urls:
        if not isinstance(u, str) or not u.startswith(("http://", "https://")):
            raise ValueError(f"vllm_server_url: {u!r} is not an http:// or https:// URL")
    return [u.rstrip("/") for u in urls]


def _dataset(dataset: Any) -> tuple[list[str] | None, str | None]:
    """JSON lines of the rows, or a .jsonl or .parquet path."""
    if isinstance(dataset, (str, os.PathLike)):
        path = Path(dataset)
        if path.suffix not in (".jsonl", ".parquet") or not path.is_file():
            raise ValueError(f"dataset: {str(path)!r} is not a .jsonl or .parquet file")
        return None, str(path)
    if isinstance(dataset, dict) or not isinstance(dataset, Iterable):
        raise TypeError(
            "dataset must be a datasets.Dataset, a list of dicts or a .jsonl or .parquet path, "
            f"got {type(dataset).__name__}"
        )
    lines = []
    for index, row in enumerate(dataset):
        if not isinstance(row, dict):
            raise TypeError(f"dataset[{index}] must be a dict with a 'prompt', got {type(row).__name__}")
        try:
            lines.append(json.dumps(row, default=_jsonable))
        except (TypeError, ValueError) as error:
            raise ValueError(f"dataset[{index}]: cannot be written as JSON: {error}") from error
    return lines, None


def _shard(shard: Any) -> str | None:
    """``"I/N"`` (checked by the engine) from ``"I/N"`` or ``(I, N)``."""
    if shard is None or isinstance(shard, str):
        return shard
    if (
        isinstance(shard, (tuple, list))
        and len(shard) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) for n in shard)
    ):
        return f"{shard[0]}/{shard[1]}"
    raise TypeError(f"shard must be 'I/N' or a pair of ints (I, N), got {shard!r}")


def _serve_rows(
    address: Any, token: Any, capacity: Any, certificate: Any, key: Any
) -> dict[str, Any]:
    """The row stream's settings; the engine checks them (the address, the token, the PEM
    files, a setting of the stream without ``serve_rows``)."""
    if address is not None and (isinstance(address, bool) or not isinstance(address, (str, int))):
        raise TypeError(f"serve_rows must be 'HOST:PORT' or a port, got {type(address).__name__}")
    if token is None and address is not None:
        token = os.environ.get("ASYNC_GRPO_ROWS_TOKEN")
    if token is not None and not isinstance(token, str):
        raise TypeError(f"serve_rows_token must be a str, got {type(token).__name__}")
    for name, path in (("serve_rows_cert", certificate), ("serve_rows_key", key)):
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"{name} must be a path, got {type(path).__name__}")
    return {
        "serve_rows": None if address is None else str(address),
        "serve_rows_token": token,
        "serve_rows_capacity": _positive_int("serve_rows_capacity", capacity),
        "serve_rows_cert": None if certificate is None else os.fspath(certificate),
        "serve_rows_key": None if key is None else os.fspath(key),
    }


def _duration(seconds: float) -> str:
    """Seconds as the engine's duration text: ``600s``, or nanoseconds when not whole."""
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{max(1, round(seconds * 1e9))}ns"


def _jsonable(value: Any) -> Any:
    """numpy scalars and arrays as JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class _PausingWeightTransfer:
    """A trainer's weight transfer that pauses a worker first (see ``RolloutWorker.weight_transfer``);
    everything else is the inner transfer's."""

    def __init__(self, inner: Any, worker: RolloutWorker) -> None:
        self._inner = inner
        self._worker = worker

    def pause(self) -> None:
        self._worker.pause_for_update()
        self._inner.pause()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class RolloutWorker:
    """A rollout worker for TRL's ``AsyncGRPOTrainer`` (``rollout_worker=``), backed by the
    Rust engine.

    The arguments are those of TRL's ``AsyncRolloutWorker`` that apply, with the same names
    and meanings, plus the engine's own (from ``estimator`` on). A wrong argument raises
    ``TypeError`` or ``ValueError`` naming it here, at construction.

    ``tools`` holds Python callables (sync or ``async def``) and built-in tools given as
    tables, the keys of the binary's ``[[tools]]``: ``{"name": "python", "kind": "python",
    "session": "rollout"}`` is a sandboxed Python interpreter per rollout whose variables,
    imports and files persist from call to call, killed when the rollout ends.

    ``environment`` is an object of OpenEnv's session-factory shape (see
    ``async_grpo._environment``): each rollout gets a session of its own, the session's
    tools are the rollout's (instead of ``tools``), a tool result with ``done`` ends the
    episode, and what ``verify`` returns is the ``env`` reward column (weighted by
    ``environment_weight``; ``reward_funcs`` may then be empty). Every session is closed
    exactly once.

    ``reward_funcs`` may mix Python callables with the engine's own rewards, by name: a spec
    string (``"numeric:answer"``, ``"exact:answer@0.5"``) or a table with the keys of the
    binary's ``[[rewards]]`` (``{"kind": "judge", "url": ..., "model": ..., "template":
    ...}``, ``{"kind": "http", "url": ...}``); these run in the engine, with no Python and no
    GIL. ``reward_func_names`` lists every function's name in order.

    ``agent`` runs each rollout with an agent that owns its loop (see ``async_grpo._agent``),
    talking to the worker's recording proxy while the engine samples every turn: a mapping
    with the keys of the binary's ``[agent]`` table (a program, run sandboxed; its ``verify``
    is the ``env`` column, weighted by its ``weight``), or a callable ``agent(task, *,
    base_url, api_key, workdir, episode_id)``, sync or ``async def`` (a number it returns is
    the ``env`` column, weighted by ``environment_weight``). With ``environment`` too, each
    rollout opens a session first and its ``verify`` judges the agent's transcript (the
    ``env`` column). An agent runs its own tools: ``tools`` must then be empty.

    What is rolled out, in which order, as the ``async-grpo rollout`` binary plans it:

    - ``dataset``: rows (a ``datasets.Dataset`` or a list of dicts, each with a
      ``prompt``), or the path of a ``.jsonl`` or ``.parquet`` file (Parquet as Hugging Face
      ``datasets`` writes it). Every row is checked at construction.
    - ``epochs``: passes over the dataset; ``None`` rolls out pass after pass until
      ``stop()``.
    - ``groups``: at most this many groups in the whole run (those a resumed ``output``
      holds count), as the binary's ``--groups``.
    - ``shuffle``: each pass in an order of its own, seeded by ``seed`` (or 0): the same
      order for the same seed, so that a resumed worker and every shard agree on it.
    - ``shard``: ``"I/N"`` or ``(I, N)`` (``0 <= I < N``): only the rows whose index modulo
      ``N`` is ``I``, so that ``N`` workers share one dataset without overlap.
    - ``output``: a file every group handed to ``rollout_buffer`` is also written to, as
      training rows (JSON Lines, or Parquet for a ``.parquet`` path, written at ``stop()``
      from a ``.partial.jsonl`` journal). An existing output holding rows is refused
      unless ``resume``.
    - ``resume``: continue ``output``: the groups it holds whole are not rolled out again,
      so that a worker made after ``stop()`` (or a crash) with the same dataset, ``epochs``,
      ``shuffle``, ``seed`` and ``shard`` goes on where the last one stopped.

    Sync tools and reward functions run in ``python_processes`` worker processes (default:
    the CPU count, at most 4), each with a GIL of its own, pickled at construction; one that
    cannot be pickled runs in this process, with a warning naming it. ``0`` runs every one
    here (``python_tool_threads`` then bounds how many run Python at once). The engine's
    tool pool, where sync tools and environment sessions run, has ``tool_threads`` threads
    (default: one per rollout in flight, at most 512, as the binary's).

    ``nice``: on Linux the engine's threads and worker processes run that many steps of nice
    value below the thread that called ``start()`` (at most 19), so that the trainer's
    threads get the CPU first when it is short; 0 runs them at the trainer's priority.

    A group's ``group_id`` is its place in the whole run (``epoch * rows + position in the
    pass``), whatever a shard or a resume leaves out.

    Off-policy rows (each sample also carries ``token_versions`` and, with
    ``routed_experts``, the experts routed for each token; see ``RolloutSample``):

    - ``in_flight``: what a weight update does to the rollouts in flight, as the binary's
      ``in_flight``: ``"wait"`` (they run to their end under the old weights), ``"abort"``
      (cancelled, their groups dropped) or ``"continue"`` (their requests interrupted with
      the tokens so far kept, continued under the new version). It applies when the trainer's
      weight transfer is wrapped: ``weight_transfer=worker.weight_transfer(inner)`` pauses the
      worker before the weights move and resumes it at ``update_model_version``, so that
      every token's version is exact. Unwrapped, TRL pauses vLLM with ``mode=keep`` and a
      request in flight across the update is labelled with the version it was sent under.
    - ``max_token_staleness``: a sampled token more than that many versions behind the
      current one when its group is complete is masked (``stale_tokens="mask"``) or its row
      dropped (``"drop"``); both are counted in the metrics.
    - ``routed_experts``: routing replay; the vLLM server must run with
      ``--enable-return-routed-experts``.

    The row stream (``docs/row-stream.md``), for a trainer in another process or on another
    machine, as the binary's ``--serve-rows``: with ``serve_rows`` the groups go to an Arrow
    Flight stream (read with ``async_grpo.RowStream(worker.rows_url)``) instead of
    ``rollout_buffer``, each held until the trainer acknowledges it, admission waiting while
    ``serve_rows_capacity`` groups are unacknowledged; the trainer's model version, pause and
    resume come back over it. ``serve_rows`` is ``PORT`` (on 127.0.0.1) or ``HOST:PORT``; an
    address other machines reach wants ``serve_rows_token`` (default: the environment's
    ``ASYNC_GRPO_ROWS_TOKEN``); ``serve_rows_cert`` and ``serve_rows_key`` (PEM files) serve
    TLS only. With ``output``, the file and the stream hold the same groups, acknowledgements
    are recorded beside it, and a resumed worker serves again what no trainer acknowledged.
    ``join()`` waits for the run to end and every group to be acknowledged.
    """

    def __init__(
        self,
        *,
        model_name: str,
        dataset: Any,
        reward_funcs: Callable[..., Any] | str | Mapping[str, Any] | Sequence[Callable[..., Any] | str | Mapping[str, Any]] | None = None,
        processing_class: Any,
        tools: Sequence[Any] | None = None,
        num_generations: int = 8,
        max_inflight_tasks: int = 128,
        queue_maxsize: int = 0,
        vllm_server_url: str | Sequence[str] = "http://localhost:8000",
        max_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        max_turns: int = 10,
        fork_threshold_tokens: int = 1024,
        max_staleness: int | None = None,
        reward_weights: Sequence[float] | None = None,
        estimator: str = "trl",
        tool_timeout: float = 60.0,
        environment: Any = None,
        environment_weight: float = 1.0,
        agent: Any = None,
        reward_timeout: float = 300.0,
        prompt_mode: str = "append",
        retries: int = 1,
        rollout_timeout: float = 600.0,
        server_wait: float = 600.0,
        max_failure_rate: float | None = 0.5,
        drain_timeout: float = 10.0,
        seed: int | None = None,
        epochs: int | None = None,
        groups: int | None = None,
        runtime_threads: int = 2,
        tool_threads: int | None = None,
        python_tool_threads: int | None = None,
        python_processes: int | None = None,
        nice: int = 10,
        shuffle: bool = False,
        shard: str | tuple[int, int] | None = None,
        output: str | os.PathLike[str] | None = None,
        resume: bool = False,
        in_flight: str = "wait",
        max_token_staleness: int | None = None,
        stale_tokens: str = "mask",
        routed_experts: bool = False,
        serve_rows: str | int | None = None,
        serve_rows_token: str | None = None,
        serve_rows_capacity: int = 64,
        serve_rows_cert: str | os.PathLike[str] | None = None,
        serve_rows_key: str | os.PathLike[str] | None = None,
    ) -> None:
        environment_name = None if environment is None else check_factory(environment)
        if agent is not None:
            check_agent(agent)
        if not isinstance(model_name, str) or not model_name:
            raise TypeError("model_name must be the served model's name (a non-empty str)")
        given = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, (str, Mapping)) else list(reward_funcs or [])
        if not given and environment is None and agent is None:
            raise ValueError(
                "reward_funcs: give at least one reward function (or an environment= or agent= whose "
                "verify rewards)"
            )
        if reward_weights is not None:
            given_weights = [float(w) for w in reward_weights]
            if len(given_weights) != len(given):
                raise ValueError(
                    f"reward_weights has {len(given_weights)} weights for {len(given)} reward functions"
                )
        # A spec string ("numeric:answer") or a table ({"kind": "judge", ...}) is built by the
        # engine, as the binary builds its [[rewards]]; its weight is reward_weights' if given,
        # else its own.
        funcs: list[Callable[..., Any]] = []
        weights: list[float] = []
        reward_tables: list[tuple[int, str, float | None]] = []
        for index, func in enumerate(given):
            weight = None if reward_weights is None else given_weights[index]
            if isinstance(func, (str, Mapping)):
                table = {"spec": func} if isinstance(func, str) else dict(func)
                try:
                    text = json.dumps(table)
                except (TypeError, ValueError) as error:
                    raise TypeError(f"reward_funcs[{index}]: a reward table must be JSON: {error}") from None
                reward_tables.append((index, text, weight))
            elif callable(func):
                funcs.append(func)
                weights.append(1.0 if weight is None else weight)
            else:
                raise TypeError(
                    f"reward_funcs[{index}] is not callable, a spec string or a reward table: {func!r}"
                )
        names = [callable_name(f) for f in funcs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"reward_funcs: two reward functions are named {duplicates[0]!r}; give one a name attribute")
        # A table ({"kind": "python", "session": "rollout"}) is a built-in tool the engine
        # builds, as the binary builds its [[tools]]; anything else a Python callable.
        entries = []
        tool_tables: list[tuple[int, str]] = []
        table_names: list[str] = []
        for i, item in enumerate(tools or []):
            if isinstance(item, Mapping) and "kind" in item:
                try:
                    tool_tables.append((i, json.dumps(dict(item))))
                except (TypeError, ValueError) as error:
                    raise TypeError(f"tools[{i}]: a tool table must be JSON: {error}") from None
                table_names.append(str(item.get("name")))
            else:
                entries.append(tool_entry(item, i))
        tool_names = [t.name for t in entries] + table_names
        if len(set(tool_names)) != len(tool_names):
            raise ValueError(f"tools: two tools share a name: {tool_names}")
        num_generations = _positive_int("num_generations", num_generations)
        max_inflight_tasks = _positive_int("max_inflight_tasks", max_inflight_tasks)
        queue_maxsize = _positive_int("queue_maxsize", queue_maxsize, 0)
        max_tokens = _positive_int("max_tokens", max_tokens)
        max_turns = _positive_int("max_turns", max_turns)
        fork_threshold_tokens = _positive_int("fork_threshold_tokens", fork_threshold_tokens, 0)
        runtime_threads = _positive_int("runtime_threads", runtime_threads)
        retries = _positive_int("retries", retries, 0)
        if max_staleness is not None:
            max_staleness = _positive_int("max_staleness", max_staleness, 0)
        if max_token_staleness is not None:
            max_token_staleness = _positive_int("max_token_staleness", max_token_staleness, 0)
        for name, value, allowed in (
            ("in_flight", in_flight, ("wait", "abort", "continue")),
            ("stale_tokens", stale_tokens, ("mask", "drop")),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        if not isinstance(routed_experts, bool):
            raise TypeError(f"routed_experts must be a bool, got {type(routed_experts).__name__}")
        if epochs is not None:
            epochs = _positive_int("epochs", epochs)
        if seed is not None:
            seed = _positive_int("seed", seed, 0)
        if groups is not None:
            groups = _positive_int("groups", groups)
        if tool_threads is not None:
            tool_threads = _positive_int("tool_threads", tool_threads)
        if python_tool_threads is not None:
            python_tool_threads = _positive_int("python_tool_threads", python_tool_threads)
        if python_processes is None:
            python_processes = min(os.cpu_count() or 1, 4)
        python_processes = _positive_int("python_processes", python_processes, 0)
        nice = _positive_int("nice", nice, 0)  # at most 19: the engine's settings say so
        temperature = _number("temperature", temperature, 0.0, 100.0)
        top_p = _number("top_p", top_p, 0.0, 1.0, low_open=True)
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
        if top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or positive, got {top_k}")
        if min_p is not None:
            min_p = _number("min_p", min_p, 0.0, 1.0)
        if max_failure_rate is not None:
            max_failure_rate = _number("max_failure_rate", max_failure_rate, 0.0, 1.0)
        for name, seconds in (
            ("tool_timeout", tool_timeout),
            ("reward_timeout", reward_timeout),
            ("rollout_timeout", rollout_timeout),
            ("server_wait", server_wait),
            ("drain_timeout", drain_timeout),
        ):
            _number(name, seconds, 0.0, 1e9, low_open=True)
        environment_weight = _number("environment_weight", environment_weight, -1e9, 1e9)
        for name, flag in (("shuffle", shuffle), ("resume", resume)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        shard = _shard(shard)
        if output is not None and not isinstance(output, (str, os.PathLike)):
            raise TypeError(f"output must be a path, got {type(output).__name__}")
        serve = _serve_rows(serve_rows, serve_rows_token, serve_rows_capacity, serve_rows_cert, serve_rows_key)
        rows, path = _dataset(dataset)
        tokenizer = tokenizer_source(processing_class)
        servers = _servers(vllm_server_url)

        self.model_name = model_name
        self.in_flight = in_flight
        self.num_generations = num_generations
        self.max_staleness = max_staleness
        self.reward_func_names = names
        self.tools = entries
        self._tool_tables = tool_tables
        self.rollout_buffer: queue.Queue[Any] = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue[dict[str, MetricValue]] = queue.Queue(maxsize=4096)
        self._drain_timeout = float(drain_timeout)
        self._loop = LoopThread()
        self._bridge = Bridge(self._loop)
        # The engine's settings, by the names the engine reads (its settings file's, or
        # TRL's where they differ), its values (durations as text, TRL's "off" values as
        # None); the engine checks them and names a key it does not know.
        settings: dict[str, Any] = {
            "num_generations": num_generations,
            "max_inflight_tasks": max_inflight_tasks,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p if top_p < 1.0 else None,
            "top_k": top_k if top_k > 0 else None,
            "min_p": min_p if min_p else None,
            "max_turns": max_turns,
            "fork_threshold_tokens": fork_threshold_tokens,
            "max_staleness": max_staleness,
            "estimator": estimator,
            "tool_timeout": _duration(tool_timeout),
            "reward_timeout": _duration(reward_timeout),
            "server_wait": _duration(server_wait),
            "max_failure_rate": max_failure_rate,
            "retries": retries,
            "rollout_timeout": _duration(rollout_timeout),
            "prompt_mode": prompt_mode,
            "seed": seed,
            "runtime_threads": runtime_threads,
            "min_group_size": min(2, num_generations),
            "tool_threads": tool_threads,
            "python_tool_threads": python_tool_threads,
            "nice": nice,
            "epochs": epochs,
            "groups": groups,
            "shuffle": shuffle,
            "shard": shard,
            "output": None if output is None else os.fspath(output),
            "resume": resume,
            "in_flight": in_flight,
            "max_token_staleness": max_token_staleness,
            "stale_tokens": stale_tokens,
            "routed_experts": routed_experts,
            **serve,
        }
        # Sync tools and rewards that can be pickled run in worker processes (a GIL each, not
        # the trainer's); the others here, with a warning. Async ones stay on the loop thread.
        moved: list[tuple[str, str, bytes]] = []

        def place(kind: str, name: str, function: Any, is_async: bool) -> int | None:
            if python_processes == 0 or is_async:
                return None
            pickled, why = placement(function)
            if pickled is None:
                logger.warning(
                    "%s %r runs in the trainer's process, not in a worker process: %s. While it runs "
                    "Python it holds the trainer's GIL, so CPU-heavy work there stalls the trainer's "
                    "threads; define it at module level (picklable) to move it, or pass "
                    "python_processes=0 to run every callable here.",
                    kind,
                    name,
                    why,
                )
                return None
            moved.append((kind, name, pickled))
            return len(moved) - 1

        tool_specs = [
            (
                t.name,
                t.description,
                json.dumps(t.parameters),
                t.function,
                t.is_async,
                place("tool", t.name, t.function, t.is_async),
            )
            for t in entries
        ]
        reward_specs = [
            (name, func, is_async, weight, place("reward", name, func, is_async))
            for name, func, weight in zip(names, funcs, weights, strict=True)
            for is_async in [returns_awaitable(func)]
        ]
        pool = None
        if moved:
            pool = (sys.executable, init_frame(moved, max_inflight_tasks), python_processes)
        agent_program = agent_function = None
        if isinstance(agent, Mapping):
            agent_program = (program_json(agent), os.getcwd(), forwarder())
        elif agent is not None:
            agent_function = (callable_name(agent), agent, returns_awaitable(agent), environment_weight)
        self._engine = _native.Engine(
            bridge=self._bridge,
            tokenizer=tokenizer,
            servers=servers,
            model=model_name,
            dataset_rows=rows,
            dataset_path=path,
            tools=tool_specs,
            rewards=reward_specs,
            environment=None
            if environment is None or environment_name is None
            else (environment_name, environment, environment_weight),
            settings=settings,
            pool=pool,
            agent_program=agent_program,
            agent_function=agent_function,
            reward_tables=reward_tables,
            tool_tables=tool_tables,
        )
        self.reward_func_names = list(self._engine.reward_names)
        self._model_version = 0
        self._paused_for_update = False
        self._lock = threading.Lock()
        self._started_at: float | None = None
        self._stopped = False
        self._stopping = threading.Event()
        self._pump: threading.Thread | None = None
        self._pump_error: BaseException | None = None
        self._last_stats: dict[str, float] = {}
        self._dropped_at_stop = 0
        self._serving = serve_rows is not None
        self._rows_tls = serve_rows_cert is not None
        self.delivered = 0
        self.report: dict[str, Any] = {}

    # -- TRL's protocol -------------------------------------------------------------------

    @property
    def model_version(self) -> int:
        return self._model_version

    def update_model_version(self, model_version: int) -> None:
        """The policy version now live: new turns record it, and with ``max_staleness`` the
        engine cancels groups left too far behind (the trainer would drop their samples). After
        ``pause_for_update`` it resumes the worker: the requests held go out under this
        version."""
        self._model_version = int(model_version)
        self._engine.set_model_version(self._model_version)
        if self._paused_for_update:
            self._paused_for_update = False
            self._engine.resume()

    # -- weight updates -------------------------------------------------------------------

    def pause_for_update(self) -> None:
        """Makes the worker ready for the weights to change, as ``in_flight`` says (see the
        class docs), and returns once they may; ``update_model_version`` resumes it."""
        if self._engine.pause(self.in_flight):
            self._paused_for_update = True

    def weight_transfer(self, inner: Any) -> Any:
        """``inner`` (the trainer's weight transfer: ``pause``, ``send_weights``, ``resume``...)
        with the worker paused for the update before ``inner.pause()``: pass it as the
        trainer's ``weight_transfer=`` so that every token's version is exact."""
        return _PausingWeightTransfer(inner, self)

    def start(self) -> None:
        """Starts the engine (it waits for the vLLM servers in the background) and the
        worker's threads. A second call does nothing."""
        with self._lock:
            if self._started_at is not None:
                logger.warning("RolloutWorker.start() called twice; ignoring")
                return
            if self._stopped:
                raise RuntimeError("this RolloutWorker was stopped; make a new one")
            self._started_at = time.monotonic()
            self._loop.start()
            self._engine.start()
            self._pump = threading.Thread(target=self._run_pump, name="async-grpo-pump", daemon=True)
            self._pump.start()
            _live_workers.add(self)

    def stop(self) -> None:
        """Drains: no new rollouts, those in flight finish for up to ``drain_timeout`` seconds
        (then are cancelled), complete groups still reach ``rollout_buffer`` while it has
        room; then joins every thread the worker started and closes ``output`` (a Parquet
        one is written now). Idempotent; also runs at interpreter exit. A
        ``KeyboardInterrupt`` during the drain cancels at once.

        With ``serve_rows``, as the binary after a signal: the stream takes no group from
        the start of the drain (those are in ``output`` only), the trainer has up to
        ``drain_timeout`` seconds to acknowledge what it holds (``report["rows_unacknowledged"]``
        counts the rest), then the stream closes. ``join()`` first to serve a bounded run
        whole."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        _live_workers.discard(self)
        if self._started_at is None:
            return
        self._stopping.set()
        interrupted = False
        try:
            self.report = dict(self._engine.shutdown(self._drain_timeout))
        except KeyboardInterrupt:
            self._engine.cancel()
            self.report = dict(self._engine.shutdown(0.0))
            interrupted = True
        finally:
            if self._pump is not None:
                self._pump.join(30.0)
            if self._serving:
                # The trainer acknowledges what the stream holds, for up to drain_timeout
                # (at once after a KeyboardInterrupt); the rest is in output, served again by a
                # resumed worker.
                wait = 0.0 if interrupted else self._drain_timeout
                self.report["rows_unacknowledged"] = self._engine.finish_rows(wait)
            self._engine.close(10.0)
            self._loop.stop(10.0)
        self.report["dropped_at_stop"] = self._dropped_at_stop
        groups, samples = self._engine.finish_output()
        self.report["output_groups"] = groups
        self.report["output_samples"] = samples
        logger.info("RolloutWorker stopped: %s", self.report)
        if self.report.get("tool_threads_left_running"):
            logger.warning(
                "RolloutWorker.stop(): %s tool threads were still running a call and were left to finish",
                self.report["tool_threads_left_running"],
            )

    def check_health(self, stale_after_s: float) -> None:
        """Raises ``RuntimeError`` with the cause when the engine failed or stopped early, or
        when its heartbeat is older than ``stale_after_s`` seconds."""
        if self._pump_error is not None:
            raise RuntimeError("the rollout worker's pump thread failed") from self._pump_error
        error = self._engine.error()
        if error is not None:
            raise RuntimeError(f"the rollout engine failed: {error}")
        if self._started_at is None:
            raise RuntimeError("the rollout worker was not started")
        if not self._engine.running():
            waited = time.monotonic() - self._started_at
            if waited > stale_after_s:
                raise RuntimeError(
                    f"the rollout worker is still waiting for the vLLM servers after {waited:.0f}s "
                    f"(> {stale_after_s:.0f}s)"
                )
            return
        age = float(self._engine.stats().get("heartbeat_age_s", 0.0))
        if age > stale_after_s:
            raise RuntimeError(
                f"the rollout engine's heartbeat is stale: {age:.1f}s > {stale_after_s:.1f}s; its runtime is blocked"
            )

    # -- Beyond the protocol --------------------------------------------------------------

    @property
    def rows_url(self) -> str | None:
        """With ``serve_rows``, once started: the row stream's URL for ``RowStream``
        (``grpc://HOST:PORT``, ``grpc+tls://`` with a certificate; the host is the address
        listened on, ``0.0.0.0`` included); ``None`` otherwise."""
        address = self._engine.rows_address
        if address is None:
            return None
        return f"{'grpc+tls' if self._rows_tls else 'grpc'}://{address}"

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the run to end (a bounded run: ``epochs`` or ``groups``): every group
        handed to ``rollout_buffer``, or with ``serve_rows`` pushed to the stream and
        acknowledged by the trainer. Whether it ended within ``timeout`` seconds (``None``:
        no bound); raises ``RuntimeError`` when the engine failed. ``stop()`` after it ends the
        worker."""
        if self._pump is None:
            raise RuntimeError("the rollout worker was not started")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._pump.join(timeout)
        if self._pump.is_alive():
            return False
        error = self._engine.error()
        if error is not None:
            raise RuntimeError(f"the rollout engine failed: {error}")
        if self._pump_error is not None:
            raise RuntimeError("the rollout worker's pump thread failed") from self._pump_error
        while True:
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if self._engine.wait_rows(max(left, 0.0)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def stats(self) -> dict[str, float]:
        """The engine's counters and gauges now (rollouts, turns, tokens, tool calls, the
        heartbeat's age and lag, ...)."""
        return dict(self._engine.stats())

    def __enter__(self) -> RolloutWorker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- The pump -------------------------------------------------------------------------

    def _run_pump(self) -> None:
        try:
            while self._serving:
                ended, forwarded = self._engine.forward(0.2)
                if ended:
                    return
                if forwarded is not None:
                    samples, pushed = forwarded
                    if pushed:
                        self.delivered += samples
                    else:
                        self._dropped_at_stop += samples
            while True:
                ended, group = self._engine.next_group(0.2)
                if ended:
                    return
                if group is not None and self._deliver(*group):
                    # In rollout_buffer whole: written to the output, if there is one.
                    self._engine.delivered()
        except BaseException as error:
            logger.error("the rollout worker's pump thread failed", exc_info=True)
            self._pump_error = error

    def _deliver(self, samples: list[dict[str, Any]], group_metrics: dict[str, float], causes: list[str]) -> bool:
        """Puts the group's samples in ``rollout_buffer``; whether every one got there."""
        whole = True
        rates: dict[str, list[float]] = {}
        reward_std = group_metrics.get("reward_std", math.nan)
        for raw in samples:
            metrics = {f"rollout/{k}": v for k, v in raw["metrics"].items()}
            reward = raw["reward"]
            metrics["reward"] = math.nan if reward is None else float(reward)
            metrics["reward_std"] = reward_std
            for name, value in json.loads(raw["rewards"]).items():
                metrics[f"rewards/{name}"] = math.nan if value is None else float(value)
            calls = raw["metrics"].get("tool_calls", 0.0)
            if self.tools or self._tool_tables:
                metrics["tools/call_frequency"] = calls
                metrics["tools/failure_frequency"] = raw["metrics"].get("tool_errors", 0.0) / calls if calls else 0.0
            for key, source in (("rollout/turns_mean", "turns"), ("completions/mean_length", "completion_tokens")):
                pair = rates.setdefault(key, [0.0, 0.0])
                pair[0] += raw["metrics"].get(source, 0.0)
                pair[1] += 1.0
            sample = RolloutSample(
                prompt=json.loads(raw["prompt"]),
                completion=json.loads(raw["completion"]),
                input_ids=raw["input_ids"],
                completion_mask=raw["completion_mask"],
                old_log_probs=raw["old_log_probs"],
                advantage=float(raw["advantage"]),
                model_version=int(raw["model_version"]),
                group_id=int(raw["group_id"]),
                metrics=metrics,
                token_versions=raw["token_versions"],
                routed_experts=raw.get("routed_experts"),
                routed_experts_missing=raw.get("routed_experts_missing"),
            )
            whole = self._put(sample) and whole
        values: dict[str, MetricValue] = {key: (num, den) for key, (num, den) in rates.items()}
        for cause in causes:
            key = f"rollout/failures/{cause}_total"
            values[key] = float(values.get(key, 0.0)) + 1.0  # type: ignore[arg-type]
        self._push_metrics(values)
        return whole

    def _put(self, sample: Any) -> bool:
        """Puts one sample in ``rollout_buffer``, waiting for room unless stopping; whether
        it got there."""
        while True:
            sample.enqueued_at = time.time()
            try:
                self.rollout_buffer.put(sample, timeout=0.1)
                self.delivered += 1
                return True
            except queue.Full:
                if self._stopping.is_set():
                    self._dropped_at_stop += 1
                    return False

    def _push_metrics(self, values: dict[str, MetricValue]) -> None:
        stats = self._engine.stats()
        for source, key in _COUNTERS.items():
            now = float(stats.get(source, 0.0))
            values[key] = now - self._last_stats.get(source, 0.0)
            self._last_stats[source] = now
        values["rollout/inflight"] = float(stats.get("in_flight", 0.0))
        values["rollout/queued"] = float(stats.get("queued", 0.0))
        values["rollout/buffer_size"] = float(self.rollout_buffer.qsize())
        values["rollout/heartbeat_age_s"] = float(stats.get("heartbeat_age_s", 0.0))
        values["rollout/scheduler_lag_p99_s"] = float(stats.get("scheduler_lag_p99_s", 0.0))
        values["rollout/scheduler_lag_max_s"] = float(stats.get("scheduler_lag_max_s", 0.0))
        try:
            self.metrics_queue.put_nowait(values)
        except queue.Full:
            pass  # never block delivery for metrics nobody reads


_live_workers: weakref.WeakSet[RolloutWorker] = weakref.WeakSet()


@atexit.register
def _stop_live_workers() -> None:
    for worker in list(_live_workers):
        try:
            worker.stop()
        except Exception:
            logger.exception("stopping a RolloutWorker at exit failed")
