"""The ONNX layer: QDQ export, fp32 ONNX import, model inspection. Public names are re-exported
from ``quantbridge``."""

from ._export import PerformanceWarning, export, float_weights, slow_form_warnings, to_onnx
from ._import import import_onnx
from ._import_module import OnnxModule
from ._import_registry import supported_ops
from ._inspect import inspect_model

__all__ = [
    "OnnxModule",
    "PerformanceWarning",
    "export",
    "float_weights",
    "import_onnx",
    "inspect_model",
    "slow_form_warnings",
    "supported_ops",
    "to_onnx",
]
