"""Worker processes for sync Python tools and reward functions, each with a GIL of its own.

A sync tool or reward function that burns Python CPU (a code checker, a sympy verifier, a
parser) holds the GIL while it runs; in the trainer's process that GIL is the trainer's, and
its threads stall. So by default each one that can be pickled runs in one of
``python_processes`` worker processes instead:

- The parent (``placement``, ``init_frame``) pickles every such callable once, at
  construction. The engine (Rust, ``src/pool.rs``) starts the processes at ``start()``, sends
  each one that frame, and then sends calls and reads answers over the process's pipes,
  without ever taking the trainer's GIL.
- A worker process (``serve``) is started as multiprocessing's ``spawn`` starts its
  children, as TRL's own worker is: the parent's ``sys.path``, and, when a callable lives in
  the script being run, that script imported as ``__mp_main__`` (so training belongs under
  ``if __name__ == "__main__":``, as TRL already asks). Calls run on a thread pool of the
  process, so tools that wait keep their concurrency; the process's stdout is the pipe of
  answers, and ``print`` in a tool goes to stderr.

Frames both ways are a 4-byte little-endian length and that many bytes: the first frame
the parent sends is the pickled ``init_frame``; after it, each frame is JSON, a call
``{"id", "fn", "args"}`` one way and an answer ``{"id", "ok", "text"}`` the other.
"""

from __future__ import annotations

import json
import logging
import multiprocessing.spawn
import os
import pickle
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

from ._callables import run_reward, run_tool

logger = logging.getLogger("async_grpo")

_MAIN = b"__main__"


def placement(function: Callable[..., Any]) -> tuple[bytes | None, str | None]:
    """``(pickled, None)`` for a callable a worker process can run, ``(None, why not)`` for
    one that must stay in the trainer's process."""
    try:
        pickled = pickle.dumps(function)
    except Exception as error:
        return None, f"it cannot be pickled ({type(error).__name__}: {error})"
    if _MAIN in pickled and not _main_importable():
        return None, "it was defined in an interactive session, which a worker process cannot import"
    return pickled, None


def _main_importable() -> bool:
    """Whether a spawned process can import the running script (``__main__`` has a file or a
    module name), as multiprocessing's spawn needs."""
    main = sys.modules.get("__main__")
    return bool(getattr(main, "__file__", None) or getattr(getattr(main, "__spec__", None), "name", None))


def init_frame(functions: list[tuple[str, str, bytes]], threads: int) -> bytes:
    """What a worker process is sent first: how to prepare itself as spawn prepares a child,
    the callables (``(kind, name, pickled)``, ``kind`` being ``"tool"`` or ``"reward"``), and
    how many calls it runs at once."""
    preparation = multiprocessing.spawn.get_preparation_data("async-grpo-pool")
    # Only a child multiprocessing spawns may carry the parent's key (it refuses to pickle
    # it otherwise); these processes speak no multiprocessing connection that would need it.
    preparation.pop("authkey", None)
    if not any(_MAIN in pickled for _, _, pickled in functions):
        # Nothing lives in the script: do not import it again.
        preparation.pop("init_main_from_path", None)
        preparation.pop("init_main_from_name", None)
    return pickle.dumps({"preparation": preparation, "functions": functions, "threads": threads})


def _read(stream: BinaryIO) -> bytes | None:
    """One frame, or None at the end of the stream."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    size = int.from_bytes(head, "little")
    body = stream.read(size)
    return body if len(body) == size else None


def serve() -> None:
    """A worker process's main: loads the callables, then runs calls until its stdin ends.

    Started by the engine as ``python -c "from async_grpo._pool import serve; serve()"``."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a tool's print() goes to stderr, never into the answers
    sys.stdout = sys.stderr
    calls = sys.stdin.buffer
    frame = _read(calls)
    if frame is None:
        return
    init = pickle.loads(frame)
    multiprocessing.spawn.prepare(init["preparation"])
    functions: list[tuple[str, str, Any]] = []
    for kind, name, pickled in init["functions"]:
        try:
            functions.append((kind, name, pickle.loads(pickled)))
        except Exception as error:
            why = f"{kind} {name!r} could not be loaded in a worker process: {type(error).__name__}: {error}"
            logger.warning("%s", why)
            functions.append((kind, name, why))
    lock = threading.Lock()

    def answer(call_id: int, ok: bool, text: str) -> None:
        body = json.dumps({"id": call_id, "ok": ok, "text": text}).encode()
        with lock:
            answers.write(len(body).to_bytes(4, "little") + body)
            answers.flush()

    def run(call: dict[str, Any]) -> None:
        kind, name, function = functions[call["fn"]]
        try:
            if isinstance(function, str):
                answer(call["id"], False, function)
            elif kind == "tool":
                answer(call["id"], *run_tool(function, name, call["args"]))
            else:
                answer(call["id"], *run_reward(function, name, call["args"]))
        except BaseException as error:  # an answer even for SystemExit, never a lost call
            answer(call["id"], False, f"{type(error).__name__}: {error}")

    pool = ThreadPoolExecutor(max_workers=max(1, int(init["threads"])), thread_name_prefix="async-grpo-call")
    while (frame := _read(calls)) is not None:
        pool.submit(run, json.loads(frame))
    # The engine closed the pipe (stop(), or the trainer is gone): calls still running are
    # not waited for.
    answers.flush()
    os._exit(0)
