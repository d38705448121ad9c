"""QuantizeLinear and DequantizeLinear: where symbolic values become program tensors.

QuantizeLinear is where every deferred computation is realized with the output's (scale, zero
point): a float graph input becomes a program input; a ``Pending`` kernel gets its requantization
(clamped by any Relu / Clip in between); an ``Elementwise`` function becomes a 256-entry table;
a program tensor with other parameters is requantized (``rescale_sum`` with one term).
DequantizeLinear gives integer initializers their parameters and checks that it reads its
QuantizeLinear partner's codes with the same scale and zero point.
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from ...numerics import common_shift_multipliers, dequantize, quantize
from .._program import Boundary, QTensor
from ._core import (
    Builder,
    Const,
    Elementwise,
    FloatInput,
    IndexValue,
    IntInput,
    LoweringError,
    MaskedScores,
    Pending,
    QConst,
    QValue,
    Value,
    as_const,
    attrs_of,
    describe_node,
    node_name,
    quantize_real,
    realize_bounded,
    register_lowering,
)
from ._rms import RowSquares
from ._rms import realize as realize_row_squares

# INT4 / UINT4 codes (ml_dtypes, as onnx reads them: opset-21 and com.microsoft Q/DQ, ORT's
# ``UseQDQContribOps`` int4 weights) are held as int8 / uint8 with their 4-bit range.
_FOUR_BIT = {"int4": (np.int8, -8, 7), "uint4": (np.uint8, 0, 15)}


def widen(a: np.ndarray) -> np.ndarray:
    """int4 / uint4 codes as int8 / uint8 (the same values); other arrays unchanged."""
    kind = _FOUR_BIT.get(str(a.dtype))
    return a.astype(kind[0]) if kind else a


def qparams(node: onnx.NodeProto, scale: Value | None, zero: Value | None) -> tuple:
    """(scale array, zero point array) of a Q/DQ node; the zero point defaults to uint8 0, or
    to ``output_dtype`` where opset 21 gives one. int4 / uint4 zero points come back as int8 /
    uint8 (``widen``). One-element parameters (shape [1], as older exporters write a per-tensor
    scale) come back as scalars: the lowerings read a per-tensor grid off 0-d arrays."""
    s = np.asarray(as_const(node, scale, "scale"))
    if zero is None:
        dtype = attrs_of(node).get("output_dtype", onnx.TensorProto.UINT8) or 2
        z = np.zeros(s.shape, onnx.helper.tensor_dtype_to_np_dtype(dtype))
    else:
        z = np.asarray(as_const(node, zero, "zero point"))
    z = widen(z)
    if s.size == 1 and z.size == 1:
        s, z = s.reshape(()), z.reshape(())
    if not np.issubdtype(z.dtype, np.integer):
        raise LoweringError(f"{describe_node(node)}: zero point type {z.dtype} is not an integer")
    return s, z


def _four_bit(node: onnx.NodeProto, zero: Value | None) -> tuple[int, int] | None:
    """The code range of a Q/DQ whose zero point is int4 / uint4 (else None)."""
    if isinstance(zero, Const) and str(zero.array.dtype) in _FOUR_BIT:
        return _FOUR_BIT[str(zero.array.dtype)][1:]
    dtype = attrs_of(node).get("output_dtype") if zero is None else None
    if dtype in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (-8, 7) if dtype == onnx.TensorProto.INT4 else (0, 15)
    return None


def _scalar(node: onnx.NodeProto, s: np.ndarray, z: np.ndarray) -> tuple[float, int]:
    if s.size != 1 or z.size != 1:
        raise LoweringError(
            f"{describe_node(node)}: per-channel quantization of an activation ({s.size} scales) "
            "cannot be lowered; quantize activations per tensor"
        )
    if z.dtype.itemsize > 2:
        raise LoweringError(f"{describe_node(node)}: {z.dtype} activations are not lowered")
    return float(s.reshape(())), int(z.reshape(()))


def same_grid(t: QTensor, scale: float, zero: int, dtype: np.dtype) -> bool:
    return t.scale == scale and t.zero_point == zero and t.dtype == dtype


def rescale_sum(
    b: Builder,
    node: str,
    inputs: list[QTensor],
    out: QTensor,
    qmin: int,
    qmax: int,
    signs: tuple[int, ...] | None = None,
) -> None:
    """``out = requantize(sum_i sign_i s_i (q_i - z_i))``: Add / Sub with any scales, or (one
    input) a requantization."""
    multipliers, shift = common_shift_multipliers([t.scale / out.scale for t in inputs])
    multipliers = multipliers * np.asarray(signs or [1] * len(inputs), np.int64)
    b.step(
        "rescale_sum",
        node,
        inputs,
        out,
        zeros=[t.zero_point for t in inputs],
        multipliers=[int(m) for m in multipliers],
        shift=int(shift),
        out_zero=out.zero_point,
        qmin=qmin,
        qmax=qmax,
        dtype=out.dtype,
    )


def table_step(
    b: Builder, node: str, source: QTensor, fn, out: QTensor, qmin: int, qmax: int
) -> None:
    """An exact lookup table: ``table[q - qmin] = quantize(fn(s (q - z)))`` in float64 for each
    of the 2**bits codes of an 8-bit ``source``, or of an int16 one (65536 entries: a group
    norm realized on int16 codes before its SiLU, ``_groupnorm``)."""
    if source.bits > 16:
        raise LoweringError(
            f"{node}: an elementwise function of a {source.bits}-bit tensor needs a "
            f"{2**source.bits}-entry table; only 8- and 16-bit inputs are lowered to tables"
        )
    codes = np.arange(source.qmin, source.qmax + 1, dtype=np.int64)
    with np.errstate(all="ignore"):
        real = np.asarray(fn((codes - source.zero_point) * np.float64(source.scale)), np.float64)
    table = quantize(real, np.float64(out.scale), np.float64(out.zero_point), qmin, qmax)
    b.step(
        "lut", node, [source], out, table=np.asarray(table).astype(out.dtype), in_qmin=source.qmin
    )


def elementwise_codes(b: Builder, name: str, v: Elementwise) -> QTensor | None:
    """A float function of 8-bit codes that a float op reads with no QuantizeLinear between
    (wav2vec2's GELU -> LayerNorm, MobileViT's SiLU -> mean): a table to symmetric int16 codes
    of ``max |f| / 32767`` (half of that per element); None when ``f`` is 0 or not finite."""
    t, top = v.source, 2**15 - 1
    with np.errstate(all="ignore"):
        f = np.asarray(v.fn((np.arange(t.qmin, t.qmax + 1) - t.zero_point) * t.scale))
    peak = float(np.abs(f).max()) if np.isfinite(f).all() else 0.0
    if peak <= 0:
        return None
    out = b.tensor(name + "_input", np.int16, peak / top, 0)
    table_step(b, v.node, t, v.fn, out, -top, top)
    return out


def float_result_codes(b: Builder, node: onnx.NodeProto, v: Value | None) -> QTensor | None:
    """Int16 codes of a float result a float op (a LayerNormalization, an average) reads with
    no QuantizeLinear between: a function of codes through ``elementwise_codes``'s table, a
    ``Pending`` with a finite bound realized on its bound's grid (``realize_bounded``); None for
    anything else."""
    if isinstance(v, Elementwise):
        return elementwise_codes(b, node_name(node), v)
    if isinstance(v, Pending) and v.bound is not None and math.isfinite(v.bound) and v.bound > 0:
        return realize_bounded(b, node_name(node) + "_input", v)
    return None


@register_lowering("QuantizeLinear")
def _quantize_linear(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    x = ins[0]
    s, z = qparams(node, ins[1], ins[2] if len(ins) > 2 else None)
    four_bit = _four_bit(node, ins[2] if len(ins) > 2 else None)
    if isinstance(x, QConst):  # DQ(weight) -> Gather / Reshape (folded) -> Q: a BERT embedding
        x = Const(np.asarray(dequantize_const(x), np.float32))
    if isinstance(x, Const):
        axis = attrs_of(node).get("axis", 1) if s.size > 1 else None
        lo, hi = four_bit or _range(z.dtype)
        q = quantize(np.asarray(x.array, np.float32), s, z, lo, hi, axis=axis)
        return [QConst(np.asarray(q).astype(z.dtype), s, z, axis)]
    if four_bit:
        raise LoweringError(
            f"{describe_node(node)}: 4-bit activations (int4 / uint4 QuantizeLinear of a computed "
            "tensor) are not lowered; quantize activations to 8 or 16 bits (4-bit weights are)"
        )
    scale, zero = _scalar(node, s, z)
    name = node.output[0]
    if isinstance(x, QValue) and same_grid(x.tensor, scale, zero, z.dtype):
        return [QValue(x.tensor, integer=True)]
    out = b.tensor(name, z.dtype, scale, zero)
    if isinstance(x, FloatInput):
        b.inputs.append(Boundary(x.name, out, True))
    elif isinstance(x, QValue | IndexValue):  # IndexValue: integers made float (a mask)
        rescale_sum(b, node_name(node), [x.tensor], out, out.qmin, out.qmax)
    elif isinstance(x, Pending):
        lo = out.qmin if x.lo == -np.inf else max(out.qmin, quantize_real(x.lo, out))
        hi = out.qmax if x.hi == np.inf else min(out.qmax, quantize_real(x.hi, out))
        x.realize(b, out, lo, min(max(lo, hi), out.qmax))
    elif isinstance(x, Elementwise):
        table_step(b, x.node, x.source, x.fn, out, out.qmin, out.qmax)
    elif isinstance(x, RowSquares):
        realize_row_squares(b, node, x, out)
    elif isinstance(x, MaskedScores) and (
        isinstance(x.scores, QValue) or isinstance(x.scores, Const) and x.scores.array.size == 1
    ):
        _quantize_masked(b, node, x, out)
    else:
        raise LoweringError(f"{describe_node(node)}: cannot quantize {type(x).__name__}")
    return [QValue(out, integer=True)]


def _quantize_masked(b: Builder, node: onnx.NodeProto, x: MaskedScores, out: QTensor) -> None:
    """A QuantizeLinear of masked scores, ``Where(keep, scores, fill)``: ONNX Runtime quantizes
    BERT's additive mask ``Where(keep, 0, finfo.min)`` (to scale 1 when calibrated without
    padding: the fill saturates to qmin) and the sum ``scores + mask`` (to a step ~1e36 when
    calibrated with padding). Kept elements are the scores requantized to the output grid (a
    one-input ``rescale_sum``); the others the fill's code: a fill <= -1e30 plus any finite
    8- or 16-bit score is the fill in float32. Exact."""
    name = node_name(node)

    def codes(value: float) -> np.ndarray:
        real = np.asarray(value, np.float32)
        return np.asarray(quantize(real, np.float32(out.scale), out.zero_point, out.qmin, out.qmax))

    fill = b.constant(name + "_fill", codes(x.fill).astype(out.dtype), out.scale, out.zero_point)
    if isinstance(x.scores, Const):
        kept_codes = codes(float(x.scores.array.reshape(()))).astype(out.dtype)
        kept = b.constant(name + "_kept", kept_codes, out.scale, out.zero_point)
    else:
        kept = b.like(name + "_kept", out)
        rescale_sum(b, name, [x.scores.tensor], kept, out.qmin, out.qmax)
    b.step("where", name, [x.keep, kept, fill], out, dtype=out.dtype)


def dequantize_const(c: QConst) -> np.ndarray:
    """The float32 values ONNX's DequantizeLinear gives for integer constant codes."""
    f32 = np.float32
    axis = c.axis if np.size(c.scale) > 1 or np.size(c.zero_point) > 1 else None
    scale, zero = np.asarray(c.scale, f32), np.asarray(c.zero_point, f32)
    if axis is None:
        scale, zero = scale.reshape(()), zero.reshape(())
    return np.asarray(dequantize(np.asarray(c.q, f32), scale, zero, axis=axis), f32)


def _range(dtype: np.dtype) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


@register_lowering("DequantizeLinear")
def _dequantize_linear(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    x = ins[0]
    s, z = qparams(node, ins[1], ins[2] if len(ins) > 2 else None)
    if isinstance(x, Const):
        codes = widen(np.asarray(x.array))
        if not np.issubdtype(codes.dtype, np.integer):
            raise LoweringError(f"{describe_node(node)}: dequantizes a float constant")
        axis = attrs_of(node).get("axis", 1) if s.size > 1 else None
        return [QConst(codes, s, z.astype(np.int64), axis)]
    if isinstance(x, QConst):
        return [x]
    scale, zero = _scalar(node, s, z)
    if isinstance(x, IntInput):
        t = b.tensor(x.name, x.dtype, scale, zero)
        b.inputs.append(Boundary(x.name, t, False))
        return [QValue(t)]
    if isinstance(x, IndexValue) and not x.logical and x.tensor.dtype == z.dtype:
        # integer codes computed by the graph: a Gather of an int8 table by token ids (ORT's
        # QOperator BERT, QLinearAdd of the embeddings): the same integers on this grid
        t = b.tensor(node.output[0], z.dtype, scale, zero)
        b.step("cast", node_name(node), [x.tensor], t, dtype=z.dtype, logical=False)
        return [QValue(t)]
    if isinstance(x, QValue):
        if not same_grid(x.tensor, scale, zero, z.dtype):
            t = x.tensor
            raise LoweringError(
                f"{describe_node(node)}: scale {scale} / zero point {zero} ({z.dtype}) differ from "
                f"its QuantizeLinear partner's ({t.scale} / {t.zero_point}, {t.dtype}) for "
                f"tensor {node.input[0]!r}; a Q -> DQ pair must share its parameters"
            )
        return [QValue(x.tensor)]
    raise LoweringError(f"{describe_node(node)}: dequantizes {type(x).__name__}, not codes")
