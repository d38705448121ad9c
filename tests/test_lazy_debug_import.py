"""``import quantbridge`` leaves the debug layer (and ONNX Runtime) for first use (issue 14, cost),
and the onnx, integer and engine layers too.

``qb.quantize`` + ``qb.export`` never need ``compare`` / ``sensitivity``; ``quantbridge/__init__``
loads them on first attribute access. Checked without a fresh interpreter (that costs a torch
import in CI): the modules that ``import quantbridge`` runs are read from the source with ``ast``,
following only the imports that execute at import time (module and class bodies, not function
bodies), and the public names are resolved in this process.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import quantbridge as qb

SRC = Path(qb.__file__).resolve().parent


def _module_path(name: str) -> Path | None:
    rel = Path(*name.split(".")[1:])
    for path in (SRC / rel / "__init__.py", (SRC / rel).with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _import_time_imports(name: str, path: Path) -> set[str]:
    """Absolute names of what ``name`` imports while it runs (function bodies skipped)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            todo.extend(node.orelse)  # the body runs for type checkers only
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + [node.module or ""])
                base = base.rstrip(".")
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # submodules, when they are
        todo.extend(ast.iter_child_nodes(node))
    return found


def _loaded_by_import() -> set[str]:
    """Every module name (ours resolved to files, third-party as written) ``import quantbridge``
    reaches through import-time imports."""
    seen: set[str] = set()
    names: set[str] = set()  # ``from .x import name``: a name, not a module
    todo = ["quantbridge"]
    while todo:
        name = todo.pop()
        if name in seen or name in names:
            continue
        path = _module_path(name) if name.split(".")[0] == "quantbridge" else None
        if path is None and name.split(".")[0] == "quantbridge":
            names.add(name)
            continue
        seen.add(name)
        if path is None:
            continue
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo.extend(parents)  # importing a.b.c runs a and a.b first
        todo.extend(_import_time_imports(name, path))
    return seen


def test_import_leaves_the_layers_above_torch_for_first_use():
    """Since 2026-12-02 the onnx, integer and engine layers load on first use too (what they
    import in turn, sympy through torch's symbolic shapes for one: tests/test_import_time.py)."""
    loaded = _loaded_by_import()
    assert "quantbridge.torch._quantize" in loaded
    above = ("quantbridge.debug", "quantbridge.onnx", "quantbridge.engine", "quantbridge.integer")
    assert not {m for m in loaded if m.startswith(above)}
    assert not {m for m in loaded if m.split(".")[0] in ("onnxruntime", "onnx", "sympy")}


def test_public_names_resolve():
    from quantbridge import debug

    for name in qb.__all__:
        assert getattr(qb, name) is not None, name
    assert qb.compare is debug.compare
    assert qb.sensitivity is debug.sensitivity
    assert qb.CompareResult is debug.CompareResult
    assert qb.debug is debug
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        qb.nope  # noqa: B018
