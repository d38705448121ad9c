"""The ONNX layer: QDQ export, model inspection. Public names are re-exported from ``quantbridge``."""

from ._export import export, float_weights, to_onnx
from ._inspect import inspect_model as inspect_model

__all__ = ["export", "float_weights", "to_onnx"]
