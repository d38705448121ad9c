"""The test tree's own shape: test directories have no ``__init__.py``, so pytest imports every
file under its bare name (``conftest``, ``debug_models``, ``test_cli``). Each ``conftest.py``
replaces the previous one in ``sys.modules``, so ``from conftest import X`` gets whichever
conftest was loaded last: ``pytest tests/debug tests/onnx`` loaded tests/onnx's and broke the
debug tests. Helpers live in uniquely named modules instead."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
    return names


def test_no_test_imports_from_a_conftest():
    offenders = [
        str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py") if "conftest" in _imported_modules(p)
    ]
    assert offenders == [], (
        f"move the helpers these import into a uniquely named module: {offenders}"
    )


def test_module_names_are_unique_across_test_directories():
    by_name = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name not in ("conftest.py", "__init__.py"):
            by_name[path.stem].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert clashes == {}, f"pytest imports test files under their bare names: rename {clashes}"
