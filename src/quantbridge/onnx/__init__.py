"""The ONNX layer, one sub-package per concern:

- ``exporter``: QDQ export of torch models (the canonical form);
- ``importer``: ONNX graphs as trainable torch modules;
- ``inspector``: what a file holds and what an engine will run in int8;
- ``passes``: ONNX-to-ONNX graph passes (``fold``: QDQ -> ONNX integer operators;
  ``openvino_layout``: Q/DQ pairs only where OpenVINO runs int8);
- ``quantizer``: a float ONNX file in, a calibrated QDQ file out (``quantize_onnx``).

Public names are re-exported from ``quantbridge``.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names below load their sub-package on first use (``__getattr__``)
    from .exporter import (
        PerformanceWarning,
        SaturationWarning,
        export,
        float_to_onnx,
        float_weights,
        slow_form_warnings,
        to_onnx,
    )
    from .importer import OnnxModule, import_onnx, supported_ops
    from .inspector import inspect_model
    from .passes import FoldQOperator, fold, openvino_layout
    from .quantizer import quantize_onnx

# Each name loads only its own sub-package: ``qb.export`` needs the exporter, not the importer
# and the folding passes it would otherwise pull in (about half of this package's import time;
# ``python -X importtime``, 2026-12-02), which ``quantize`` + ``export`` never run.
_LAZY = {
    **dict.fromkeys(
        (
            "PerformanceWarning",
            "SaturationWarning",
            "export",
            "float_to_onnx",
            "float_weights",
            "slow_form_warnings",
            "to_onnx",
        ),
        "exporter",
    ),
    **dict.fromkeys(("OnnxModule", "import_onnx", "supported_ops"), "importer"),
    "inspect_model": "inspector",
    **dict.fromkeys(("FoldQOperator", "fold", "openvino_layout"), "passes"),
    "quantize_onnx": "quantizer",
}


def __getattr__(name: str):
    package = _LAZY.get(name)
    if package is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{package}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "FoldQOperator",
    "OnnxModule",
    "PerformanceWarning",
    "SaturationWarning",
    "export",
    "float_to_onnx",
    "float_weights",
    "fold",
    "import_onnx",
    "inspect_model",
    "openvino_layout",
    "quantize_onnx",
    "slow_form_warnings",
    "supported_ops",
    "to_onnx",
]
