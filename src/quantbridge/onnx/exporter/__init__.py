"""QDQ export: a ``QuantModel`` (or float torch model) as a canonical QDQ ONNX file.

Owns the one-trace export from the captured program (``_torch_onnx``), the translation of
quantbridge's custom quantize/dequantize ops to QuantizeLinear/DequantizeLinear (``_translate``),
opset selection and downgrade (``_opset``) and int4 weight packing (``_int4``). Reads the torch
layer; knows nothing of import, inspection or folding.
"""

from ._export import (
    PerformanceWarning,
    SaturationWarning,
    export,
    float_weights,
    slow_form_warnings,
    to_onnx,
)

__all__ = [
    "PerformanceWarning",
    "SaturationWarning",
    "export",
    "float_weights",
    "slow_form_warnings",
    "to_onnx",
]
