"""ONNX translations of the torch export ops (``quantbridge.torch._export_ops``).

``quantize_dequantize(x, scale, zero_point, qmin, qmax, axis)`` becomes::

    QuantizeLinear(x, scale, zero_point[, axis]) -> DequantizeLinear(., scale, zero_point[, axis])

when ``[qmin, qmax]`` is the full range of the zero point's integer type, and::

    QuantizeLinear -> Clip(., qmin, qmax) -> DequantizeLinear

otherwise (narrow range, or fewer than 8 bits carried in an 8-bit type before opset 21). The Clip
runs on the integer tensor, after saturation, which is exactly ``clip(round(x/s)+z, qmin, qmax)``;
ONNX Runtime accepts integer Clip and keeps fusing the surrounding operators (see
``bench/forms_study/FINDINGS.md``).

``dequantize(q, scale, zero_point, axis)`` becomes one DequantizeLinear whose ``q`` is the integer
initializer (int8 weights, int32 biases); ``dequantize_blocked(q, scale, zero_point, axis,
block_size)`` (group-wise weights of an imported file) one DequantizeLinear with ``block_size``
(opset 21; the exporter asks for it, ``_export._choose_opset``).

``dynamic_quantize_dequantize(x)`` (``torch/_dynamic.py``, a model imported from a dynamically
quantized file) becomes ``DynamicQuantizeLinear(x) -> DequantizeLinear(y, y_scale, y_zero_point)``.

``aten._safe_softmax`` (the decomposed SDPA with a mask, ``torch/_sdpa.py``: a fully masked row
gives 0) becomes ``Softmax -> Where(IsNaN(p), 0, p)``, the form torch's TorchScript exporter
writes for SDPA and which ``integer.lowering`` lowers (torchlib's own form, ``Equal(x, -inf)``
and ``ReduceMin`` on the float scores, has no integer lowering). The same values wherever the
scores hold no NaN (a NaN score gives a 0 row here, NaN in torch).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxscript
import torch

from ...torch._dynamic import dynamic_quantize_dequantize as _dynamic_op  # noqa: F401 - registers

_FULL_RANGE = {
    onnx.TensorProto.INT8: (-128, 127),
    onnx.TensorProto.UINT8: (0, 255),
    onnx.TensorProto.INT16: (-32768, 32767),
    onnx.TensorProto.UINT16: (0, 65535),
}
_NP = {
    onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT8: np.uint8,
    onnx.TensorProto.INT16: np.int16,
    onnx.TensorProto.UINT16: np.uint16,
}


def _dtype_of(value) -> int:
    dtype = getattr(value, "dtype", None)
    return int(dtype) if dtype is not None else onnx.TensorProto.UINT8


def translation_table(opset: int) -> dict:
    """Translation functions for ``torch.onnx.export(custom_translation_table=...)``."""
    op = onnxscript.values.Opset("", opset)

    def _axis_kwargs(axis):
        return {} if axis is None else {"axis": axis}

    def quantize_dequantize(x, scale, zero_point, qmin: int, qmax: int, axis=None):
        q = op.QuantizeLinear(x, scale, zero_point, **_axis_kwargs(axis))
        dtype = _dtype_of(zero_point)
        if dtype in _FULL_RANGE and (qmin, qmax) != _FULL_RANGE[dtype]:
            np_dtype = _NP[dtype]
            lo = op.Constant(value=onnx.numpy_helper.from_array(np.array(qmin, dtype=np_dtype)))
            hi = op.Constant(value=onnx.numpy_helper.from_array(np.array(qmax, dtype=np_dtype)))
            q = op.Clip(q, lo, hi)
        return op.DequantizeLinear(q, scale, zero_point, **_axis_kwargs(axis))

    def dequantize(q, scale, zero_point, axis=None):
        return op.DequantizeLinear(q, scale, zero_point, **_axis_kwargs(axis))

    def dequantize_blocked(q, scale, zero_point, axis: int, block_size: int):
        return op.DequantizeLinear(q, scale, zero_point, axis=axis, block_size=block_size)

    def dynamic_quantize_dequantize(x):
        y, y_scale, y_zero_point = op.DynamicQuantizeLinear(x)
        return op.DequantizeLinear(y, y_scale, y_zero_point)

    def safe_softmax(x, dim: int, dtype=None):
        p = op.Softmax(x, axis=dim)
        zero = op.Constant(value=onnx.numpy_helper.from_array(np.array(0, dtype=np.float32)))
        return op.Where(op.IsNaN(p), zero, p)

    return {
        torch.ops.aten._safe_softmax.default: safe_softmax,
        torch.ops.quantbridge.quantize_dequantize.default: quantize_dequantize,
        torch.ops.quantbridge.dequantize.default: dequantize,
        torch.ops.quantbridge.dequantize_blocked.default: dequantize_blocked,
        torch.ops.quantbridge.dynamic_quantize_dequantize.default: dynamic_quantize_dequantize,
    }
