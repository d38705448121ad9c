"""QDQ export: a ``QuantModel`` (or float torch model) as a canonical QDQ ONNX file.

Owns the one-trace export from the captured program (``_torch_onnx``), the translation of
quantbridge's custom quantize/dequantize ops to QuantizeLinear/DequantizeLinear (``_translate``),
opset selection and downgrade (``_opset``), int4 weight packing (``_int4``) and the call
signature recorded in the file's metadata (``_signature``). Reads the torch
layer; knows nothing of import, inspection or folding.
"""

from ._export import (
    PerformanceWarning,
    SaturationWarning,
    export,
    float_to_onnx,
    float_weights,
    slow_form_warnings,
    to_onnx,
)
from ._signature import SIGNATURE_KEY

__all__ = [
    "SIGNATURE_KEY",
    "PerformanceWarning",
    "SaturationWarning",
    "export",
    "float_to_onnx",
    "float_weights",
    "slow_form_warnings",
    "to_onnx",
]
