"""The example examples/row-stream/train.py as a user runs it: the binary serves the
quickstart's rows (``--serve-rows``) and the example, a plain PyTorch loop in another
process, trains on every group, acknowledges each after its step and moves the engine's
model version between steps. Needs torch (this venv's) and the binary (``ASYNC_GRPO_BIN``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "row-stream" / "train.py"
QUICKSTART = ROOT / "examples" / "quickstart"


def test_a_pytorch_loop_in_another_process_trains_on_every_group_and_moves_the_version(tmp_path: Path) -> None:
    binary = os.environ.get("ASYNC_GRPO_BIN", "")
    assert binary and Path(binary).is_file(), f"ASYNC_GRPO_BIN is {binary!r}"
    groups = 16
    config = tmp_path / "run.toml"
    # The quickstart's task (a calculator call, then an answer right half the time), one group
    # held at a time and two rollouts in flight: the engine keeps pace with the trainer, so
    # later groups are sampled after the trainer's version moved.
    config.write_text(
        f'dataset = "{QUICKSTART / "arithmetic.jsonl"}"\ntokenizer = "{QUICKSTART}"\n'
        f'num_generations = 4\ngroups = {groups}\nmax_inflight = 2\nmax_turns = 4\n'
        'out = "rows.jsonl"\nserve_rows = "127.0.0.1:0"\nserve_rows_capacity = 1\nprogress = "off"\n'
        '[[rewards]]\nspec = "numeric:answer"\n'
        '[[tools]]\nname = "calculator"\nkind = "calculator"\n'
        "[simulator]\ntool_rounds = 1\ncorrect_rate = 0.5\n"
    )
    engine = subprocess.Popen(
        [binary, "rollout", "--config", str(config)], cwd=tmp_path, stderr=subprocess.PIPE, text=True
    )
    assert engine.stderr is not None
    url = ""
    for line in engine.stderr:
        found = re.search(r"serving rows on (\S+)", line)
        if found:
            url = "grpc://" + found.group(1)
            break
    assert url, "the engine never said where it serves rows"
    said: list[str] = []
    drain = threading.Thread(target=lambda: said.extend(engine.stderr or []), daemon=True)
    drain.start()

    trainer = subprocess.run(
        [sys.executable, str(EXAMPLE), url, "--version-every", "3", "--vocab", "512"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert trainer.returncode == 0, trainer.stderr
    assert engine.wait(timeout=120) == 0, "".join(said)
    drain.join(timeout=10)
    steps = [json.loads(line) for line in trainer.stdout.splitlines()]
    assert [step["step"] for step in steps] == list(range(1, groups + 1))
    assert sorted(step["position"] for step in steps) == list(range(groups))
    assert all(step["rows"] == 4 for step in steps)
    # The engine's advantages reached the loss: a group of right and wrong answers moves it.
    assert any(step["loss"] != 0 for step in steps), steps
    assert not any("not acknowledged" in line for line in said), "".join(said)
    # The versions the trainer posted reached the engine: the last groups were sampled
    # under a version it moved to (16 steps, an update every 3: versions 1 to 5).
    assert max(step["sampled_by"] for step in steps) >= 1, steps
    versions = [json.loads(line)["model_version"] for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert max(versions) >= 1
