"""4-bit weights at opset >= 21: integer initializers stored as ONNX INT4 / UINT4.

torch has no 4-bit dtype, so the exporter writes 4-bit weights (codes within [-8, 7] or
[0, 15]) as int8 / uint8 initializers. At opset 21 and later, DequantizeLinear takes INT4 / UINT4
inputs, so this pass re-types each such weight initializer (and gives its DequantizeLinear its
own zero-point initializer of the same 4-bit type: the exporter shares equal zero points between
quantizers). The codes are unchanged; the file holds two codes per byte (``raw_data``). Below opset 21 the int8
container stays - the values are the same either way.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def pack_4bit_weights(model: onnx.ModelProto, weight_bits: dict[str, tuple[int, bool]]) -> int:
    """Re-type 4-bit weight initializers. ``weight_bits``: initializer name -> (bits, signed).
    Returns how many were converted."""
    inits = {i.name: i for i in model.graph.initializer}
    converted = 0
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in weight_bits:
            continue
        bits, signed = weight_bits[node.input[0]]
        if bits > 4 or node.input[0] not in inits:
            continue
        dtype = TensorProto.INT4 if signed else TensorProto.UINT4
        codes = numpy_helper.to_array(inits[node.input[0]])
        lo, hi = (-8, 7) if signed else (0, 15)
        assert codes.min() >= lo and codes.max() <= hi, node.input[0]
        _replace(model, inits[node.input[0]], dtype, codes)
        if len(node.input) > 2 and node.input[2] in inits:
            zero_point = numpy_helper.to_array(inits[node.input[2]])
            name = node.input[0] + ".zero_point4"
            model.graph.initializer.append(_tensor(name, dtype, zero_point))
            node.input[2] = name
        converted += 1
    if converted:
        used = {name for n in model.graph.node for name in n.input}
        keep = [i for i in model.graph.initializer if i.name in used]
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)
    return converted


def _tensor(name: str, dtype: int, values: np.ndarray) -> onnx.TensorProto:
    """A 4-bit initializer stored as ``raw_data``, two codes per byte (low nibble first).
    ``make_tensor`` packs the pairs but keeps each packed byte as a varint in ``int32_data``,
    which takes up to 2 bytes per byte on disk: the file would not shrink to half."""
    tensor = helper.make_tensor(name, dtype, list(values.shape), values.astype(np.int64).flatten())
    packed = np.asarray(tensor.int32_data, dtype=np.uint8).tobytes()
    del tensor.int32_data[:]
    tensor.raw_data = packed
    return tensor


def _replace(model: onnx.ModelProto, init: onnx.TensorProto, dtype: int, codes: np.ndarray) -> None:
    new = _tensor(init.name, dtype, codes)
    init.CopyFrom(new)
