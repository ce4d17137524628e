#!/bin/sh
# After the agent, in the same directory: the task's test. Exit 0 (reward 1.0) when it
# passes, 1 (reward 0.0) when it fails or solution.py is missing or broken.
[ -f solution.py ] || exit 1
python3 test_solution.py >/dev/null 2>&1 || exit 1
