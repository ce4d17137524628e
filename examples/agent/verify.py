"""Judges what the agent left: exit 0 (reward 1.0) when its solution.py's solve() returns the
task's answer, exactly an int; exit 1 (reward 0.0) otherwise; exit 2 (no reward, an error in
the run's log) when this verifier itself cannot work (no dataset row on stdin).

    python3 verify.py < row.json      # in the agent's directory, after the agent exited

The engine runs it after the agent exited, in the agent's directory, with the dataset row
as JSON on stdin (`{"prompt": ..., "answer": "42"}`). This file lives outside that
directory and the answer reaches no place the agent could read before it exits. What the
agent wrote is untrusted: only solution.py is taken, copied into a directory of our own and
run in a separate interpreter that never sees the answer; its value is compared here. See
README.md ("Why verify is built this way").
"""

import ctypes
import json
import os
import stat
import subprocess
import sys
import tempfile

PR_SET_DUMPABLE = 4
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
CAP_SYS_PTRACE = 19
# How long solve() may run, and how large solution.py and its printed value may be.
TIMEOUT_SECONDS = 20
MAX_SOLUTION_BYTES = 1 << 20
MAX_OUTPUT_BYTES = 1 << 16

# Runs in the child, in the copy's directory: imports solution and writes json.dumps(solve())
# to the original stdout; anything solution itself prints goes to /dev/null.
RUNNER = """
import json, os, sys
result = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
sys.path.insert(0, os.getcwd())
import solution
text = json.dumps(solution.solve())
result.write(text)
result.flush()
"""


class Unusable(Exception):
    """This verifier cannot judge (its input or its machine), whatever the agent did."""


def read_row() -> dict:
    """The dataset row on stdin, read to its end before anything of the agent's runs."""
    text = sys.stdin.buffer.read()
    try:
        row = json.loads(text)
    except ValueError as error:
        raise Unusable(f"stdin is not a dataset row as JSON ({error}); is the engine new enough?")
    if not isinstance(row, dict) or "answer" not in row:
        raise Unusable("the dataset row on stdin has no \"answer\"")
    try:
        return {"answer": int(str(row["answer"]).strip())}
    except ValueError:
        raise Unusable(f"the row's answer {row['answer']!r} is not an integer")


def not_dumpable() -> None:
    """No core dumps, and no /proc/PID/mem or ptrace of this process for a non-root peer."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise Unusable(f"prctl(PR_SET_DUMPABLE, 0) failed: errno {ctypes.get_errno()}")


def without_ptrace() -> None:
    """In the child before exec: root keeps no CAP_SYS_PTRACE (which overrides not_dumpable),
    nor can it regain it. A non-root child has nothing to drop."""
    libc = ctypes.CDLL(None, use_errno=True)
    # Already gone from the bounding set (a sandbox that dropped every capability): done.
    if libc.prctl(PR_CAPBSET_READ, CAP_SYS_PTRACE, 0, 0, 0) == 0:
        return
    if libc.prctl(PR_CAPBSET_DROP, CAP_SYS_PTRACE, 0, 0, 0) != 0:
        os._exit(3)


def copy_solution(workdir: str) -> bool:
    """Copies ./solution.py, a regular file and not a link, into `workdir`."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open("solution.py", flags)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as source:
        info = os.fstat(source.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_SOLUTION_BYTES:
            return False
        text = source.read(MAX_SOLUTION_BYTES + 1)
    if len(text) > MAX_SOLUTION_BYTES:
        return False
    with open(os.path.join(workdir, "solution.py"), "wb") as copy:
        copy.write(text)
    return True


def solve_value(workdir: str):
    """What solve() returned, as JSON parsed here, or None when it did not run to the end."""
    environment = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "LANG": "C.UTF-8",
    }
    try:
        child = subprocess.run(
            [sys.executable, "-I", "-c", RUNNER],
            cwd=workdir,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            timeout=TIMEOUT_SECONDS,
            preexec_fn=without_ptrace,
        )
    except subprocess.TimeoutExpired:
        return None
    if child.returncode != 0 or len(child.stdout) > MAX_OUTPUT_BYTES:
        return None
    try:
        return json.loads(child.stdout)
    except ValueError:
        return None


def passes(expected: int) -> bool:
    with tempfile.TemporaryDirectory(prefix="verify-") as workdir:
        if not copy_solution(workdir):
            return False
        value = solve_value(workdir)
    # Parsed JSON: an int is an int (not a bool, a float or an object with its own __eq__).
    return type(value) is int and value == expected


def main() -> int:
    try:
        row = read_row()
        not_dumpable()
    except Unusable as error:
        print(f"verify.py: {error}", file=sys.stderr)
        return 2
    try:
        return 0 if passes(row["answer"]) else 1
    except Exception as error:  # noqa: BLE001 - whatever the agent left, a failure is 0.0
        print(f"verify.py: {type(error).__name__}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
