"""ONNX in, INT8 ONNX out: ``quantize_onnx`` (``quantbridge quantize``).

Owns the checking and batching of calibration data given as arrays keyed by graph input name
(``_calib_data``) and the flow import -> quantize -> export that keeps the file's interface
(``_quantize_onnx``). No quantization logic of its own: placement, calibration and the QDQ form
are the torch layer's and the exporter's.
"""

from ._calib_data import CalibrationSet, GraphInput, graph_inputs
from ._quantize_onnx import quantize_onnx

__all__ = ["CalibrationSet", "GraphInput", "graph_inputs", "quantize_onnx"]
