"""``import quantbridge`` loads numerics, recipe and torch only: the onnx package (with
ml_dtypes, 0.7 s), onnxscript, onnxruntime and sympy (0.3-0.4 s) load on first use of a name
that needs them (``quantbridge.__getattr__``; sympy when a pickled QuantModel is read), and
``quantbridge --help`` imports the debug commands without their engines.

Measured with ``python -X importtime -c "import quantbridge"`` (5 runs interleaved with the
code before, 2 cores at load 4-5, 2026-12-02): quantbridge beyond torch 1.93 s -> 0.25 s
(median); ``quantbridge --help`` 6.6 s -> 2.5 s wall. The test checks what is imported, never
the time."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("onnx", "onnxscript", "onnxruntime", "ml_dtypes", "sympy", "openvino", "transformers")


def test_import_quantbridge_loads_no_onnx_and_no_sympy():
    code = (
        "import json, sys, quantbridge as qb\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
        "from quantbridge.cli import _parser\n"
        "_parser().format_help()  # quantbridge --help\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
        "from quantbridge import import_onnx  # a lazy name loads its layer on first use\n"
        "print(json.dumps([m in sys.modules for m in ('onnx', 'quantbridge.onnx')]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported, help_imported, lazy = (json.loads(line) for line in out.stdout.splitlines())
    assert imported == [] and help_imported == [] and lazy == [True, True]
