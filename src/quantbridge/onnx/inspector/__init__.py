"""Inspection of an ONNX file: op counts, which ops an engine runs in int8 and which in float,
Q/DQ pairs left, weight storage dtypes, opset and size (``quantbridge inspect``).

Reads ONNX only; knows nothing of torch.
"""

from ._graph import bits_for_range
from ._inspect import inspect_model
from ._report import InspectReport, TensorInfo, WeightInfo

__all__ = ["InspectReport", "TensorInfo", "WeightInfo", "bits_for_range", "inspect_model"]
