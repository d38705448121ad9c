"""The ONNX layer: QDQ export, model inspection. Public names are re-exported from ``quantbridge``."""

from ._export import PerformanceWarning, export, float_weights, slow_form_warnings, to_onnx
from ._inspect import inspect_model

__all__ = [
    "PerformanceWarning",
    "export",
    "float_weights",
    "inspect_model",
    "slow_form_warnings",
    "to_onnx",
]
