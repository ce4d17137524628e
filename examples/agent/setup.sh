#!/bin/sh
# Before the agent, in the rollout's fresh directory: the task's test, from its dataset row
# ($1, the row as JSON).
set -eu
python3 - "$1" <<'PY'
import json
import pathlib
import sys

task = json.loads(sys.argv[1])
pathlib.Path("test_solution.py").write_text(
    "import solution\n\n"
    f"assert solution.solve() == {int(task['answer'])}, f'solve() returned {{solution.solve()!r}}'\n"
)
PY
