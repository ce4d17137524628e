"""The engine compiled from Rust (``crates/trl-bridge/src``). ``RolloutWorker`` drives
``Engine``; ``Simulator`` and ``__version__`` are re-exported by ``async_grpo``."""

from collections.abc import Sequence
from os import PathLike
from typing import Any, final

__all__ = ["Engine", "Inbox", "Simulator", "agent_forward", "__version__"]

__version__: str

# A tool as the Python side describes it: name, description, JSON schema of the parameters
# (text), the callable, whether it is async, and for a sync one the worker processes run,
# its place in their init frame.
_ToolSpec = tuple[str, str, str, Any, bool, int | None]
# A reward function: name, the callable, whether it is async, its weight, its place in the
# worker processes' init frame when they run it.
_Reward = tuple[str, Any, bool, float, int | None]
# The worker processes: the Python interpreter, the frame each starts from, how many.
_Pool = tuple[str | PathLike[str], bytes, int]
# An environment: its name, the session factory, the weight of its reward.
_Environment = tuple[str, Any, float]
# A loop-owning agent program: the `[agent]` table as JSON text, the directory its relative
# paths are from, the forwarder's command line.
_AgentProgram = tuple[str, str | PathLike[str], Sequence[str]]
# A Python agent: its name, the callable, whether it is async, the weight of its `env` column.
_AgentFunction = tuple[str, Any, bool, float]
# A reward table: its place among `reward_funcs`, its settings as JSON, its weight if given.
_RewardTable = tuple[int, str, float | None]
# A built-in tool table: its place among `tools=`, its settings as JSON.
_ToolTable = tuple[int, str]
# A tokenizer folder, or `(tokenizer_json, tokenizer_config_json)`.
_Tokenizer = str | PathLike[str] | tuple[str, str]

@final
class Engine:
    """The rollout engine on a runtime of its own."""

    def __new__(
        cls,
        *,
        bridge: Any,
        tokenizer: _Tokenizer,
        servers: Sequence[str],
        model: str | None,
        dataset_rows: Sequence[str] | None,
        dataset_path: str | PathLike[str] | None,
        tools: Sequence[_ToolSpec],
        rewards: Sequence[_Reward],
        environment: _Environment | None,
        settings: dict[str, Any],
        pool: _Pool | None = None,
        agent_program: _AgentProgram | None = None,
        agent_function: _AgentFunction | None = None,
        reward_tables: Sequence[_RewardTable] = ...,
        tool_tables: Sequence[_ToolTable] = ...,
    ) -> Engine: ...
    @property
    def reward_names(self) -> list[str]:
        """The names of ``reward_funcs``' functions, in order."""
    def start(self) -> None:
        """Opens the output, starts the runtime and the loop."""
    def next_group(self, timeout: float) -> tuple[bool, Any | None]:
        """The next scored group, waiting up to ``timeout`` seconds: ``(False, group)``,
        ``(False, None)`` on a timeout, ``(True, None)`` once every group was read."""
    def delivered(self) -> None:
        """Says the last group handed out was delivered: it is written to the output."""
    def forward(self, timeout: float) -> tuple[bool, tuple[int, bool] | None]:
        """With a row stream: the next group written to the output and pushed to the stream,
        waiting up to ``timeout`` seconds for one: ``(False, (samples, pushed))``, ``(False,
        None)`` on a timeout, ``(True, None)`` once every group was forwarded."""
    @property
    def rows_address(self) -> str | None:
        """Where the row stream listens (``HOST:PORT``), once started."""
    def wait_rows(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for every group the stream holds to be
        acknowledged; whether it was."""
    def finish_rows(self, timeout: float) -> int:
        """Ends the row stream once every group is acknowledged or after ``timeout``
        seconds; the groups left unacknowledged."""
    def finish_output(self) -> tuple[int, int]:
        """Closes the output; the groups and samples written to it."""
    def set_model_version(self, version: int) -> None:
        """Turns sampled from now on record ``version``."""
    def pause(self, mode: str) -> bool:
        """Pauses the loop for a weight update (``wait``, ``abort`` or ``continue``)."""
    def resume(self) -> None:
        """Resumes the loop after ``pause``."""
    def error(self) -> str | None:
        """Why the engine failed or stopped early, if it did."""
    def running(self) -> bool:
        """Whether the loop is running."""
    def stats(self) -> dict[str, float]:
        """Counters and gauges under the loop's metric names."""
    def shutdown(self, drain_timeout: float) -> dict[str, Any]:
        """Stops admission, drains for up to ``drain_timeout`` seconds; what the drain did."""
    def cancel(self) -> None:
        """Cancels every rollout in flight at once."""
    def close(self, timeout: float) -> None:
        """Shuts the runtime down and kills the worker processes."""

@final
class Inbox:
    """The ``async def`` calls the engine hands to the worker's asyncio loop, without the GIL:
    the loop watches ``fileno()`` for reading and then ``take()``s every call waiting."""

    def __new__(cls) -> Inbox: ...
    def fileno(self) -> int:
        """The descriptor that becomes readable when calls are waiting."""
    def open(self) -> None:
        """Takes calls from now on (the loop runs)."""
    def close(self) -> None:
        """Takes no more calls; those waiting are told the loop stopped."""
    def take(self) -> list[tuple[Any, ...]]:
        """Every entry waiting, in order: ``("call", id, kind, function, name, payload, done)``
        (``done(ok, text)`` reports the call's end) or ``("cancel", id)``."""

@final
class Simulator:
    """A vLLM-compatible simulator (scripted answers, not a model) on a runtime of its own."""

    def __new__(cls, tokenizer: str | PathLike[str], **settings: Any) -> Simulator: ...
    @property
    def url(self) -> str:
        """The server's base URL (``http://127.0.0.1:PORT``)."""
    def transcript(self) -> list[tuple[list[int], list[int], list[float], str]]:
        """Every ``/v1/completions`` answer so far: ``(prompt_ids, token_ids, logprobs,
        finish_reason)``."""
    def set_weights(self, version: int) -> None:
        """Loads weights of ``version``: answers from now on are those of these weights."""
    def weights(self) -> list[tuple[int, bool]]:
        """For each answer so far: the version that sampled it, and whether it changed
        mid-answer."""
    def completions(self) -> int:
        """Generation requests answered so far."""
    def stop(self) -> None:
        """Stops serving and joins the simulator's threads. Idempotent."""

def agent_forward(argv: Sequence[str]) -> int:
    """The agents' forwarder: ``--port PORT --socket PATH -- COMMAND...``."""
