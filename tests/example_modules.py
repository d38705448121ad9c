"""The scripts in ``examples/`` as modules, for the tests that run them: ``load_example("minilm")``
executes ``examples/minilm.py`` once per process under the name ``qb_example_minilm`` (registered
in ``sys.modules`` before it runs: dataclasses look their module up there)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(stem: str) -> ModuleType:
    name = f"qb_example_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
