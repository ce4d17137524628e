"""Importing ``async_grpo`` prints none of TRL's experimental notice, and its ``RolloutSample``
extends TRL's own (with the per-token fields of off-policy training): the one of the ``AsyncGRPOTrainer`` that ``trl`` exports (TRL's stable API), else TRL
1.16's in ``trl.experimental.async_grpo``, else the package's own dataclass.

Every import runs in a fresh interpreter (``sys.executable -c``) without
``TRL_EXPERIMENTAL_SILENCE`` or ``PYTHONWARNINGS``: TRL warns only when ``trl.experimental`` is
first imported. The lookup order is checked against fake ``trl`` packages put ahead of the real
one on ``PYTHONPATH``, so it needs no TRL newer than the installed one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NOTICE = "You are importing from 'trl.experimental'"
IMPORTED = "--- async_grpo imported ---"

# Imports async_grpo, then reports on stdout: the module of the class its RolloutSample extends, whether
# trl.experimental was imported, whether the caller still sees TRL's notice (no filter against
# it left behind) and has no TRL_EXPERIMENTAL_SILENCE. A marker on stderr separates what the
# import printed from what follows.
IMPORT_ASYNC_GRPO = f"""
import os, sys, warnings
import async_grpo
print({IMPORTED!r}, file=sys.stderr, flush=True)
print(async_grpo.RolloutSample.__bases__[0].__module__)
print("trl.experimental" in sys.modules)
from trl.import_utils import TRLExperimentalWarning
with warnings.catch_warnings(record=True) as shown:
    warnings.warn_explicit({NOTICE!r}, TRLExperimentalWarning, "user.py", 1, registry={{}})
print(len(shown) == 1 and "TRL_EXPERIMENTAL_SILENCE" not in os.environ)
"""


def fresh_python(code: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRL_EXPERIMENTAL_SILENCE", "PYTHONWARNINGS")}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return done


def import_async_grpo(pythonpath: Path | None = None) -> tuple[str, str, bool, bool]:
    """What importing async_grpo printed on stderr, its RolloutSample's module, whether
    trl.experimental got imported, whether the notice's filters and variable were left alone."""
    done = fresh_python(IMPORT_ASYNC_GRPO, pythonpath)
    printed, marker, _ = done.stderr.partition(IMPORTED)
    assert marker, done.stderr
    module, experimental, untouched = done.stdout.split()[-3:]
    return printed, module, experimental == "True", untouched == "True"


def test_trl_warns_when_trl_experimental_is_first_imported() -> None:
    """The notice the other tests look for is there to see in a fresh interpreter."""
    assert NOTICE in fresh_python("import trl.experimental").stderr


def test_importing_async_grpo_prints_no_experimental_notice_and_gives_trl_1_16_s_rollout_sample() -> None:
    printed, module, experimental, untouched = import_async_grpo()
    assert NOTICE not in printed
    assert "TRLExperimentalWarning" not in printed
    assert untouched
    assert experimental
    assert module == "trl.experimental.async_grpo.async_rollout_worker"
    same = fresh_python(
        "import async_grpo\n"
        "from trl.experimental.async_grpo.async_rollout_worker import RolloutSample\n"
        "print(async_grpo.RolloutSample.__bases__ == (RolloutSample,))"
    )
    assert same.stdout.split()[-1:] == ["True"]


def real_trl_file(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin)


def fake_trl(root: Path, *, stable: bool, experimental: bool) -> Path:
    """A ``trl`` package in ``root``: ``stable`` exports ``AsyncGRPOTrainer`` from ``trl``, its
    module importing the ``RolloutSample`` it trains on from ``trl.trainer``; ``experimental``
    has TRL 1.16's ``trl.experimental.async_grpo.async_rollout_worker.RolloutSample`` behind
    TRL 1.16's own ``trl/experimental/__init__.py`` (the notice)."""
    trl = root / "trl"
    trl.mkdir()
    shutil.copy(real_trl_file("trl.import_utils"), trl / "import_utils.py")
    (trl / "__init__.py").write_text(
        "from .trainer.async_grpo_trainer import AsyncGRPOTrainer\n" if stable else ""
    )
    if stable:
        (trl / "trainer").mkdir()
        (trl / "trainer" / "__init__.py").write_text("")
        (trl / "trainer" / "async_rollout_worker.py").write_text("class RolloutSample:\n    pass\n")
        (trl / "trainer" / "async_grpo_trainer.py").write_text(
            "from .async_rollout_worker import RolloutSample\n\n\nclass AsyncGRPOTrainer:\n    pass\n"
        )
    if experimental:
        (trl / "experimental" / "async_grpo").mkdir(parents=True)
        shutil.copy(real_trl_file("trl.experimental"), trl / "experimental" / "__init__.py")
        (trl / "experimental" / "async_grpo" / "__init__.py").write_text("")
        (trl / "experimental" / "async_grpo" / "async_rollout_worker.py").write_text(
            "class RolloutSample:\n    pass\n"
        )
    return root


def test_the_fake_trl_experimental_warns_as_trl_1_16_does(tmp_path: Path) -> None:
    fake = fake_trl(tmp_path, stable=False, experimental=True)
    assert NOTICE in fresh_python("import trl.experimental", fake).stderr


@pytest.mark.parametrize(
    ("stable", "experimental", "expected"),
    [
        (True, True, "trl.trainer.async_rollout_worker"),
        (True, False, "trl.trainer.async_rollout_worker"),
        (False, True, "trl.experimental.async_grpo.async_rollout_worker"),
        (False, False, "async_grpo._sample"),
    ],
    ids=["stable-and-experimental", "stable-only", "experimental-only", "neither"],
)
def test_rollout_sample_comes_from_trl_s_stable_api_before_trl_experimental(
    tmp_path: Path, stable: bool, experimental: bool, expected: str
) -> None:
    printed, module, imported_experimental, untouched = import_async_grpo(
        fake_trl(tmp_path, stable=stable, experimental=experimental)
    )
    assert module == expected
    # With the stable API there, trl.experimental is never imported at all.
    assert imported_experimental == (experimental and not stable)
    assert NOTICE not in printed
    assert untouched
