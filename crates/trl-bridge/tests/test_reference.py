"""``docs/reference/python.md`` is what the package's declarations say now: written by
``tools/api_reference.py`` (``cargo xtask docs``) from the exports, signatures and
docstrings of the sources (``_native.pyi`` for the compiled module), so no argument's
description drifts from its code."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import shutil
from types import ModuleType

BRIDGE = pathlib.Path(__file__).resolve().parents[1]
COMMITTED = BRIDGE.parents[1] / "docs" / "reference" / "python.md"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("api_reference", BRIDGE / "tools" / "api_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_python_reference_is_the_packages() -> None:
    assert COMMITTED.read_text() == generator().reference(), (
        "docs/reference/python.md is stale (a signature or docstring changed): run `cargo xtask docs` and commit it"
    )


def test_a_changed_docstring_makes_the_reference_stale(tmp_path: pathlib.Path) -> None:
    package = tmp_path / "async_grpo"
    shutil.copytree(BRIDGE / "python" / "async_grpo", package)
    stub = package / "_native.pyi"
    text = stub.read_text()
    edited = text.replace('"""Stops serving and joins the simulator\'s threads. Idempotent."""', '"""Stops serving."""')
    assert edited != text, "the docstring this test edits is gone: pick another"
    stub.write_text(edited)
    reference = generator().reference(package)
    assert reference != COMMITTED.read_text()
    assert "Stops serving.\n" in reference


def test_every_export_is_documented_with_its_signature() -> None:
    reference = COMMITTED.read_text()
    init = ast.parse((BRIDGE / "python" / "async_grpo" / "__init__.py").read_text())
    exported = next(
        ast.literal_eval(node.value)
        for node in init.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
    )
    assert exported
    for name in exported:
        assert f"## `{name}`" in reference, name
    # RolloutWorker's every keyword argument, as the class declares it.
    worker = ast.parse((BRIDGE / "python" / "async_grpo" / "_worker.py").read_text())
    init = next(
        node
        for node in ast.walk(worker)
        if isinstance(node, ast.FunctionDef) and node.name == "__init__" and node.args.kwonlyargs
        and node.args.kwonlyargs[0].arg == "model_name"
    )
    for arg in init.args.kwonlyargs:
        assert re.search(rf"^        {arg.arg}: ", reference, re.MULTILINE), arg.arg
    # Every code block is Python that parses (a stub's declarations).
    for block in re.findall(r"```python\n(.*?)```", reference, re.DOTALL):
        ast.parse(block)
