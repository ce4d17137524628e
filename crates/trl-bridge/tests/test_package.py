"""The package as a user installs it: from its wheel, with no Rust toolchain on the machine.

These checks apply when `cargo xtask pytest` runs the suite (`ASYNC_GRPO_WHEEL_TEST=1`): the
wheel installed into a venv, cargo and rustc off PATH. Run by hand from a development build,
they are skipped, saying why.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import shutil
import tomllib

import pytest

import async_grpo

ROOT = pathlib.Path(__file__).resolve().parents[3]

as_installed = pytest.mark.skipif(
    os.environ.get("ASYNC_GRPO_WHEEL_TEST") != "1",
    reason="only for the wheel as `cargo xtask pytest` installs it",
)


@as_installed
def test_the_package_runs_from_its_installed_wheel_with_no_rust_toolchain() -> None:
    assert shutil.which("cargo") is None and shutil.which("rustc") is None
    installed = pathlib.Path(async_grpo.__file__).resolve()
    assert "site-packages" in installed.parts, installed
    assert ROOT not in installed.parents, f"imported from the source tree: {installed}"


@as_installed
def test_the_wheel_is_one_abi3_wheel_for_cpython_3_10_and_later_with_a_manylinux_tag() -> None:
    distribution = importlib.metadata.distribution("async-grpo")
    wheel = distribution.read_text("WHEEL") or ""
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
    assert len(tags) == 1, wheel
    python, abi, platform = tags[0].split("-")
    assert (python, abi) == ("cp310", "abi3"), tags
    assert platform.startswith("manylinux_"), tags
    typed = [str(file) for file in distribution.files or [] if file.name in ("py.typed", "_native.pyi")]
    assert sorted(typed) == ["async_grpo/_native.pyi", "async_grpo/py.typed"], typed


def test_one_version_for_the_crates_and_the_package() -> None:
    workspace = tomllib.loads((ROOT / "Cargo.toml").read_text())
    version = workspace["workspace"]["package"]["version"]
    assert async_grpo.__version__ == version
    assert importlib.metadata.version("async-grpo") == version


def test_the_trl_extra_allows_every_release_the_bridge_supports() -> None:
    requires = importlib.metadata.requires("async-grpo") or []
    trl = [r for r in requires if r.startswith("trl") and r.split(";")[-1].replace("'", '"').strip() == 'extra == "trl"']
    assert len(trl) == 1, requires
    assert trl[0].split(";")[0].replace(" ", "") in ("trl<2,>=1.16", "trl>=1.16,<2"), trl
