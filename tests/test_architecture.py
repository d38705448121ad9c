"""The package's shape, read from its source with ``ast`` (nothing is imported):

* imports run one way, down the layer order of DESIGN.md: numerics, calibrate, recipe, torch,
  onnx, integer, engine, debug, cli (``optables``, ``_version`` and ``_platform`` sit at the
  bottom with numerics, ``zoo`` is plain torch models and sits with torch; ``demo``, ``cli`` and
  the package's own ``__init__`` / ``__main__`` (the public API) at the top);
* no import cycle between modules, counting imports inside functions too (a function-level import
  that dodges a cycle is still a cycle);
* no module over 450 lines.

Sub-packages that do not exist yet (integer/, engine/, debug/) are accepted when they appear; a
new top-level module or package must be given a layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "quantbridge"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE
MAX_LINES = 450

# top-level module or sub-package -> layer (imports may only go to an equal or lower layer)
LAYERS: dict[str, int] = {
    "_version": 0,
    "_platform": 0,
    "optables": 0,
    "numerics": 0,
    "calibrate": 1,
    "recipe": 2,
    "_recipe_parts": 2,  # AdaRound and the dict key check, re-exported by recipe
    "torch": 3,
    "zoo": 3,
    "onnx": 4,
    "integer": 5,
    "engine": 6,
    "debug": 7,
    "demo": 8,
    "cli": 8,
    "_cli_debug": 8,  # the compare / sensitivity arguments, without importing debug
    "__init__": 8,  # the public API: cli and demo use it as users do
    "__main__": 8,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (``from ..x import y`` -> 'quantbridge.x')."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Every module of the package that ``module`` imports, at any depth of its body."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            # ``from . import x`` imports the module ``x`` when there is one
            targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets = targets or [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # quantbridge.onnx.export -> quantbridge.onnx
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != module:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(m, p, known) for m, p in modules.items()}


def _layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top not in LAYERS:
        raise KeyError(top)
    return top, LAYERS[top]


def test_every_top_level_module_has_a_layer():
    unknown = sorted({m.split(".")[1] for m in _modules() if "." in m} - set(LAYERS))
    assert not unknown, f"give {unknown} a layer in LAYERS (see DESIGN.md's layer order)"


def test_imports_run_down_the_layers():
    upward = []
    for module, targets in _graph().items():
        top, layer = _layer(module)
        for target in sorted(targets):
            target_top, target_layer = _layer(target)
            if target_layer > layer:
                upward.append(f"{module} ({top}) imports {target} ({target_top})")
    assert not upward, "imports running up the layer order:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_check_finds_a_cycle_and_an_upward_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _layer("quantbridge.numerics._affine") == ("numerics", 0)
    assert _layer("quantbridge.cli") == ("cli", 8)
    with pytest.raises(KeyError):
        _layer("quantbridge.unplaced")


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_module_size(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(SRC)} has {lines} lines (max {MAX_LINES})"
