"""QDQ rules of the normalisation (Cases 1-4 of ``_quantized``): QuantizeLinear,
DequantizeLinear, and Clip on integer tensors (narrow and sub-8-bit grids)."""

from __future__ import annotations

import numpy as np
import onnx

from ...numerics import quantize
from ._quantized import SITE_OP, Normaliser, rule


# -- QDQ (Cases 1-4) -----------------------------------------------------------------------------
@rule("QuantizeLinear")
def _quantize_linear(ctx: Normaliser, node: onnx.NodeProto) -> None:
    attrs = ctx.attrs(node)
    if attrs.get("block_size", 0):
        raise ValueError(f"{ctx.where(node)}: blocked quantization (block_size) is not supported")
    x, y = node.input[0], node.output[0]
    out_type = attrs.get("output_dtype") or None
    qp = ctx.qparams(node, x, 1, 2, attrs.get("axis", 1), out_type)
    if x in ctx.consts:  # Case 1: a float weight -> Q: its integers now
        codes = quantize(ctx.consts[x].astype(np.float32), qp.scale,
                         qp.zero_point.astype(np.float32), qp.qmin, qp.qmax, qp.axis)  # fmt: skip
        ctx.consts[y] = np.asarray(codes).astype(np.int32)
        ctx.const_types[y] = qp.onnx_type
        return
    ctx.site(x, y, qp, x)  # Case 1 (per channel too: NNCF's inputs of depthwise convs)


@rule("DequantizeLinear")
def _dequantize_linear(ctx: Normaliser, node: onnx.NodeProto) -> None:
    attrs = ctx.attrs(node)
    if attrs.get("block_size", 0):
        raise ValueError(f"{ctx.where(node)}: blocked quantization (block_size) is not supported")
    y, out = node.input[0], node.output[0]
    if y in ctx.consts and ctx.consts[y].dtype == np.int32 and y not in ctx.const_types:
        qp_scale = ctx.const(node.input[1])
        zero = ctx.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if qp_scale is None or (zero is not None and np.any(zero != 0)):
            raise ValueError(
                f"{ctx.where(node)}: an int32 DequantizeLinear (a bias) needs a constant scale "
                "and zero point 0"
            )
        ctx.dequantize_bias(node, y, qp_scale, name=out)
        return
    qp = ctx.qparams(node, y, 1, 2, attrs.get("axis", 1))
    if y in ctx.consts:  # Case 2
        source = ctx.read(node, y, qp)
        if source != out:  # the same integers dequantized before: one more name for them
            ctx.add_const(out, ctx.consts[source])
            ctx.record.weights[out] = ctx.record.weights[source]
        return
    ctx.read(node, y, qp)  # Case 3: checks the grid
    ctx.emit("Identity", [y], [out], name=node.name)
    ctx.record.dequantized[out] = ctx.record.tensor_grid[y]


@rule("Clip", quantized=False)
def _clip(ctx: Normaliser, node: onnx.NodeProto) -> None:
    site = ctx.grid(node.input[0])
    if site is None:  # a float Clip
        ctx.default(node)
        return
    bounds = [ctx.const(i) if i else None for i in list(node.input[1:3])]
    attrs = ctx.attrs(node)
    if ctx.opset < 11:
        bounds = [attrs.get("min"), attrs.get("max")]
    if any(
        b is None and i < len(node.input) - 1 and node.input[i + 1] for i, b in enumerate(bounds)
    ):
        raise ValueError(f"{ctx.where(node)}: integer Clip bounds must be constants")
    qp = site.qparams
    lo = qp.qmin if len(bounds) < 1 or bounds[0] is None else int(bounds[0])
    hi = qp.qmax if len(bounds) < 2 or bounds[1] is None else int(bounds[1])
    narrow = qp.narrowed(lo, hi, ctx.where(node))
    x, out = node.input[0], node.output[0]
    producer = ctx.nodes[-1] if ctx.nodes else None
    only_reader = ctx.readers.get(x, 0) == 1
    if (
        only_reader
        and producer is not None
        and producer.op_type == SITE_OP
        and producer.output[0] == x
    ):
        site.qparams = narrow  # Case 4: the Q writes the narrow grid
        ctx.emit("Identity", [x], [out], name=node.name)
        ctx.record.tensor_grid[out] = site.grid
        return
    ctx.site(x, out, narrow, out)  # Case 4: another reader sees the full grid
