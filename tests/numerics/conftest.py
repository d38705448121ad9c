"""Make ``src/`` importable when quantbridge is not installed (e.g. a fresh checkout)."""

import importlib.util
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

if importlib.util.find_spec("quantbridge") is None:
    sys.path.insert(0, str(SRC))
