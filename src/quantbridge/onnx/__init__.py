"""The ONNX layer, one sub-package per concern:

- ``exporter``: QDQ export of torch models (the canonical form);
- ``importer``: ONNX graphs as trainable torch modules;
- ``inspector``: what a file holds and what an engine will run in int8;
- ``passes``: ONNX-to-ONNX graph passes (``fold``: QDQ -> ONNX integer operators;
  ``openvino_layout``: Q/DQ pairs only where OpenVINO runs int8);
- ``quantizer``: a float ONNX file in, a calibrated QDQ file out (``quantize_onnx``).

Public names are re-exported from ``quantbridge``.
"""

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
