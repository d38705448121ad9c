"""Every third-party package the library imports is declared in pyproject.toml (a dependency or an
extra), not only reached through another package's requirements (regression: ``onnx_ir``, which
``onnx/exporter/_tiny_constants.py`` imports, came in only through ``onnxscript``)."""

from __future__ import annotations

import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


_IMPORT = re.compile(r"^\s*(?:from\s+([A-Za-z_]\w*)\S*\s+import\b|import\s+([A-Za-z_]\w*))")


def _imported_top_level_modules() -> dict[str, str]:
    """Top-level module name -> first file (relative) that imports it, over src/quantbridge; an
    import right after ``try:`` is optional (the idiom for an ImportError with its own message)."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "src" / "quantbridge").rglob("*.py")):
        previous = ""
        for line in path.read_text().splitlines():
            match = _IMPORT.match(line)
            if match and previous != "try:":
                found.setdefault(match[1] or match[2], str(path.relative_to(ROOT)))
            if line.strip():
                previous = line.strip()
    return found


def _declared_distributions() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()  # no tomllib on Python 3.10
    project = text.split("[project]", 1)[1].split("\n[tool.", 1)[0]
    names = re.findall(r'^\s*"([A-Za-z0-9_.-]+)\s*(?:\[[^\]]*\])?\s*[<>=!~;"]', project, re.M)
    return {_normalise(n) for n in names}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_package_is_declared():
    distributions = packages_distributions()
    declared = _declared_distributions()
    missing = []
    for module, where in _imported_top_level_modules().items():
        if module in sys.stdlib_module_names or module in ("quantbridge", "__future__"):
            continue
        owners = {_normalise(d) for d in distributions.get(module, [])}
        assert owners, f"{where} imports {module!r}, which no installed distribution provides"
        if not owners & declared:
            missing.append(f"{module} ({'/'.join(sorted(owners))}, imported in {where})")
    assert not missing, "imported but not declared in pyproject.toml: " + ", ".join(missing)
