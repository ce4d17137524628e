"""A key-value store environment, served over MCP (Python SDK `mcp` 2.x).

Each episode (one rollout) gets a store of its own. The task (the dataset row) names a goal:
the store must hold the value of the row's expression under that expression. The model gets
two tools: `calculator` (evaluates `A op B` and writes the result under the expression) and
`read` (a key's value). The reward: 0 unless the store is in the goal state; then 1.0 for a
task marked `"done_on_goal": true` (its episode ends as soon as the goal is stored), else 0.5,
plus 0.5 when the final answer states the value. Each `calculator` call also gives a step
reward: 0.25 when it stored the goal's value, else 0. Conventions of async-grpo's MCP
environments:

- `reset(task, seed, episode_id)`: called once before the first turn with the dataset row;
  hidden from the model.
- a tool result `{"done": true, ...}` ends the episode (here: the goal stored, for a task
  marked `done_on_goal`).
- a tool result `{"reward": R, ...}` is a step reward: the row's `step_rewards` holds it
  for the assistant turn that made the call (summed over the turn's calls), and
  `credit = "turn"` gives that turn credit for it.
- `verify(transcript)`: called once at the end, hidden from the model; returns the reward
  with metrics.

Run it on stdio (`python3 kv_env.py`), or over streamable HTTP
(`python3 kv_env.py --http PORT`, endpoint http://127.0.0.1:PORT/mcp). With the environment
variable KV_ENV_LOG set, every verify appends `{"episode_id", "reward"}` to that file (tests
compare it with the rows).
"""

import json
import os
import re
import sys

from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("kv-env")
EPISODES: dict[str, dict] = {}


def episode(ctx: Context) -> dict:
    """The calling MCP session's episode (stdio: one per process)."""
    headers = ctx.headers or {}
    key = headers.get("mcp-session-id", "stdio")
    return EPISODES.setdefault(key, {"store": {}, "goal": None, "episode_id": None, "calls": 0})


def stored(state: dict) -> bool:
    """Whether the store is in the goal state."""
    goal = state["goal"]
    return goal is not None and state["store"].get(goal[0]) == goal[1]


def evaluate(expression: str):
    match = re.fullmatch(r"\s*(-?\d+)\s*([-+*/])\s*(-?\d+)\s*", expression)
    if match is None:
        raise ValueError(f"cannot evaluate {expression!r}: expected A op B")
    a, op, b = int(match[1]), match[2], int(match[3])
    if op == "/":
        if b == 0:
            raise ValueError("division by zero")
        return a / b if a % b else a // b
    return {"+": a + b, "-": a - b, "*": a * b}[op]


@server.tool()
def reset(task: dict, seed: int, episode_id: str, ctx: Context) -> str:
    """Starts an episode for a dataset row."""
    state = episode(ctx)
    prompt = task.get("prompt", [])
    text = " ".join(m.get("content", "") for m in prompt if isinstance(m, dict))
    found = re.findall(r"-?\d+\s*[-+*/]\s*-?\d+", text)
    state.update(store={}, calls=0, episode_id=episode_id, seed=seed)
    state["done_on_goal"] = bool(task.get("done_on_goal"))
    state["goal"] = (found[-1], str(task.get("answer"))) if found else None
    return "ready"


@server.tool()
def calculator(expression: str, ctx: Context) -> dict:
    """Evaluates an arithmetic expression `A op B` and stores the result under it."""
    state = episode(ctx)
    state["calls"] += 1
    result = evaluate(expression)
    before = stored(state)
    state["store"][expression.strip()] = str(result)
    step = 0.25 if stored(state) and not before else 0.0
    return {"result": result, "done": state["done_on_goal"] and stored(state), "reward": step}


@server.tool()
def read(key: str, ctx: Context) -> str:
    """The value stored under a key, or an empty string."""
    return episode(ctx)["store"].get(key, "")


@server.tool()
def verify(transcript: list[dict], ctx: Context) -> dict:
    """The episode's reward (see the module's docs)."""
    state = episode(ctx)
    answers = [m for m in transcript if m.get("role") == "assistant"]
    final = (answers[-1].get("content") or "") if answers else ""
    if not stored(state):
        reward = 0.0
    elif state["done_on_goal"]:
        reward = 1.0
    else:
        reward = 0.5 + (0.5 if state["goal"][1] in final else 0.0)
    log = os.environ.get("KV_ENV_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as out:
            out.write(json.dumps({"episode_id": state["episode_id"], "reward": reward}) + "\n")
    return {
        "reward": reward,
        "metrics": {"calls": state["calls"], "messages": len(transcript)},
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", port=int(sys.argv[2]))
    else:
        server.run()
