"""QDQ rules of the normalisation (Cases 1-4 of ``_quantized``): QuantizeLinear,
DequantizeLinear, and Clip on integer tensors (narrow and sub-8-bit grids).

Case 4b: a Clip of an integer constant (Brevitas's QCDQ export writes each weight as
``int8 codes -> Clip(lo, hi) -> DequantizeLinear``, ``[-7, 7]`` for 4-bit narrow-range weights)
clips the codes and narrows the grid the DequantizeLinear reads them on, so a fine-tuned weight
stays on the file's grid.

Blocked quantization (opset 21 ``block_size``: group-wise int4 / uint4 / int8 / uint8 weights, as
ONNX Runtime's ``MatMulNBitsQuantizer`` in QDQ format and ModelOpt's int4 modes write them) is
imported for constants: a DequantizeLinear of integer codes (Case 2) and a QuantizeLinear of a
float weight (Case 1). A blocked Q / DQ of a run-time tensor (an activation) is refused."""

from __future__ import annotations

import numpy as np
import onnx

from ...numerics import quantize
from ._qparams import INTEGER_TYPES, onnx_type_of, type_range
from ._quantized import SITE_OP, Normaliser, rule


# -- QDQ (Cases 1-4) -----------------------------------------------------------------------------
@rule("QuantizeLinear")
def _quantize_linear(ctx: Normaliser, node: onnx.NodeProto) -> None:
    attrs = ctx.attrs(node)
    x, y = node.input[0], node.output[0]
    block_size = _block_size(ctx, node, attrs, x)
    out_type = attrs.get("output_dtype") or None
    qp = ctx.qparams(node, x, 1, 2, attrs.get("axis", 1), out_type, block_size)
    if x in ctx.consts:  # Case 1: a float weight -> Q: its integers now
        codes = quantize(ctx.consts[x].astype(np.float32), qp.scale,
                         qp.zero_point.astype(np.float32), qp.qmin, qp.qmax, qp.axis,
                         qp.block_size)  # fmt: skip
        ctx.consts[y] = np.asarray(codes).astype(np.int32)
        ctx.const_types[y] = qp.onnx_type
        return
    ctx.site(x, y, qp, x)  # Case 1 (per channel too: NNCF's inputs of depthwise convs)


@rule("DequantizeLinear")
def _dequantize_linear(ctx: Normaliser, node: onnx.NodeProto) -> None:
    attrs = ctx.attrs(node)
    y, out = node.input[0], node.output[0]
    block_size = _block_size(ctx, node, attrs, y)
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
    codes_type = ctx.const_types.get(y) or (
        onnx_type_of(ctx.consts[y]) if y in ctx.consts else None
    )
    qp = ctx.qparams(node, y, 1, 2, attrs.get("axis", 1), codes_type if block_size else None,
                     block_size)  # fmt: skip
    if y in ctx.const_bounds:  # Case 4b
        qp = qp.narrowed(*ctx.const_bounds[y], ctx.where(node))
    if y in ctx.consts:  # Case 2
        source = ctx.read(node, y, qp)
        if source != out:  # the same integers dequantized before: one more name for them
            ctx.add_const(out, ctx.consts[source])
            ctx.record.weights[out] = ctx.record.weights[source]
        return
    ctx.read(node, y, qp)  # Case 3: checks the grid
    ctx.emit("Identity", [y], [out], name=node.name)
    ctx.record.dequantized[out] = ctx.record.tensor_grid[y]


def _block_size(ctx: Normaliser, node: onnx.NodeProto, attrs: dict, x: str) -> int | None:
    """The node's ``block_size`` (None when 0 or absent); ValueError for a run-time tensor."""
    block_size = int(attrs.get("block_size", 0)) or None
    if block_size is not None and x not in ctx.consts:
        raise ValueError(
            f"{ctx.where(node)}: blocked quantization (block_size={block_size}) of the run-time "
            f"tensor {x!r}; quantbridge imports blocked weights (constants) only. Quantize that "
            "activation per tensor"
        )
    return block_size


def _integer_codes(ctx: Normaliser, x: str) -> bool:
    codes = ctx.consts.get(x)
    return codes is not None and (x in ctx.const_types or onnx_type_of(codes) in INTEGER_TYPES)


def _clip_bounds(ctx: Normaliser, node: onnx.NodeProto, qmin: int, qmax: int) -> tuple[int, int]:
    bounds = [ctx.const(i) if i else None for i in list(node.input[1:3])]
    attrs = ctx.attrs(node)
    if ctx.opset < 11:
        bounds = [attrs.get("min"), attrs.get("max")]
    if any(
        b is None and i < len(node.input) - 1 and node.input[i + 1] for i, b in enumerate(bounds)
    ):
        raise ValueError(f"{ctx.where(node)}: integer Clip bounds must be constants")
    lo = qmin if len(bounds) < 1 or bounds[0] is None else int(bounds[0])
    hi = qmax if len(bounds) < 2 or bounds[1] is None else int(bounds[1])
    return lo, hi


@rule("Clip", quantized=False)
def _clip(ctx: Normaliser, node: onnx.NodeProto) -> None:
    x, out = node.input[0], node.output[0]
    if _integer_codes(ctx, x):  # Case 4b: integer weight codes -> Clip -> DQ
        codes = ctx.consts[x]
        qmin, qmax = type_range(ctx.const_types.get(x) or onnx_type_of(codes))
        lo, hi = _clip_bounds(ctx, node, qmin, qmax)
        if x in ctx.const_bounds:  # a Clip of clipped codes
            lo, hi = max(lo, ctx.const_bounds[x][0]), min(hi, ctx.const_bounds[x][1])
        ctx.consts[out] = np.clip(codes, lo, hi).astype(codes.dtype)
        if x in ctx.const_types:
            ctx.const_types[out] = ctx.const_types[x]
        ctx.const_bounds[out] = (lo, hi)
        return
    site = ctx.grid(x)
    if site is None:  # a float Clip
        ctx.default(node)
        return
    qp = site.qparams
    narrow = qp.narrowed(*_clip_bounds(ctx, node, qp.qmin, qp.qmax), ctx.where(node))
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
