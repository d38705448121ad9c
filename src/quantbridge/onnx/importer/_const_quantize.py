"""Weights stored float and quantized at run time, folded into integer codes.

NVIDIA ModelOpt's ONNX PTQ (fp32 and fp16 modes) and alike write a weight as a float
initializer followed by ``QuantizeLinear -> DequantizeLinear``::

    W (float initializer) -> QuantizeLinear(W, scale, zero_point, axis=0) -> DequantizeLinear -> Conv

instead of the canonical int8 initializer + DequantizeLinear. ONNX Runtime then runs the Conv in
float (its QDQ fusions want a constant integer weight), ``inspect`` sees no int8 weight, ``fold``
leaves the Conv in QDQ form. ``fold_constant_quantize`` computes each such QuantizeLinear once:

* Case 1: a ``QuantizeLinear`` whose ``x``, ``y_scale`` and ``y_zero_point`` are initializers
  (``x`` of a float type, the zero point int8 / uint8 / int16 / uint16, or absent: uint8 0)
  becomes an initializer named as its output, holding
  ``numerics.quantize(x, scale, zero_point, qmin, qmax, axis)`` (ONNX QuantizeLinear: one IEEE
  division, round half to even, saturation) in the zero point's dtype;
* Case 2: the float initializer ``x`` is removed once no node reads it any more.

Not applied: a QuantizeLinear with ``block_size`` (opset 21 blocked quantization) or an
``output_dtype`` other than the zero point's, one that writes a graph output, and 4-bit or
float8 zero points. Only the main graph is rewritten.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ...numerics import quantize

_RANGES = {
    onnx.TensorProto.INT8: (np.int8, -128, 127),
    onnx.TensorProto.UINT8: (np.uint8, 0, 255),
    onnx.TensorProto.INT16: (np.int16, -32768, 32767),
    onnx.TensorProto.UINT16: (np.uint16, 0, 65535),
}
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)


def constant_quantize_nodes(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The main graph's QuantizeLinear nodes that ``fold_constant_quantize`` computes."""
    inits = {t.name: t for t in proto.graph.initializer}
    outputs = {o.name for o in proto.graph.output}
    return [n for n in proto.graph.node if _foldable(n, inits, outputs)]


def fold_constant_quantize(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``proto`` whose QuantizeLinear of a float initializer is an integer initializer
    (module docstring); ``proto`` itself when there is none."""
    if not constant_quantize_nodes(proto):
        return proto
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    keep, new, sources = [], [], set()
    for node in graph.node:
        if not _foldable(node, inits, outputs):
            keep.append(node)
            continue
        new.append(_codes(node, inits))  # Case 1
        sources.add(node.input[0])
    read = {t for n in keep for t in n.input} | {o.name for o in graph.output}
    for n in keep:  # subgraphs may read outer-scope initializers
        for attr in n.attribute:
            for g in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                read |= {t for sub in g.node for t in sub.input}
    keep = [onnx.NodeProto.FromString(n.SerializeToString()) for n in keep]
    del graph.node[:]
    graph.node.extend(keep)
    unused = sources - read  # Case 2
    kept = [onnx.TensorProto.FromString(t.SerializeToString())
            for t in graph.initializer if t.name not in unused]  # fmt: skip
    del graph.initializer[:]
    graph.initializer.extend([*kept, *new])
    inputs = [onnx.ValueInfoProto.FromString(i.SerializeToString()) for i in graph.input]
    del graph.input[:]
    graph.input.extend(i for i in inputs if i.name not in unused)
    return out


def _foldable(node: onnx.NodeProto, inits: dict, outputs: set[str]) -> bool:
    if node.op_type != "QuantizeLinear" or node.domain not in ("", "ai.onnx"):
        return False
    if node.output[0] in outputs or node.input[0] not in inits:
        return False
    if len(node.input) < 2 or node.input[1] not in inits:
        return False
    if inits[node.input[0]].data_type not in _FLOATS:
        return False
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("block_size", 0):
        return False
    zp = node.input[2] if len(node.input) > 2 and node.input[2] else None
    if zp is not None and (zp not in inits or inits[zp].data_type not in _RANGES):
        return False
    zp_type = inits[zp].data_type if zp else attrs.get("output_dtype", 0) or onnx.TensorProto.UINT8
    if zp_type not in _RANGES:
        return False
    return attrs.get("output_dtype", 0) in (0, zp_type)


def _codes(node: onnx.NodeProto, inits: dict) -> onnx.TensorProto:
    x = numpy_helper.to_array(inits[node.input[0]])
    scale = numpy_helper.to_array(inits[node.input[1]])
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    zp_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
    if zp_name:
        zero_point = numpy_helper.to_array(inits[zp_name])
        dtype, qmin, qmax = _RANGES[inits[zp_name].data_type]
    else:
        dtype, qmin, qmax = _RANGES[attrs.get("output_dtype", 0) or onnx.TensorProto.UINT8]
        zero_point = np.zeros_like(scale, dtype=dtype)
    axis = None if scale.size == 1 else attrs.get("axis", 1) % x.ndim  # one scale: per-tensor
    # float16 x and scale are exact in float32, where ONNX Runtime also divides
    x = x.astype(np.float32) if x.dtype == np.float16 else x
    scale = scale.astype(x.dtype)
    codes = quantize(x, scale.reshape(-1) if axis is not None else scale.reshape(()),
                     zero_point.reshape(-1) if axis is not None else zero_point.reshape(()),
                     qmin, qmax, axis)  # fmt: skip
    return numpy_helper.from_array(np.asarray(codes).astype(dtype), node.output[0])


__all__ = ["constant_quantize_nodes", "fold_constant_quantize"]
