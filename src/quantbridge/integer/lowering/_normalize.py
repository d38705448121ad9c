"""Lowering of Softmax and LayerNormalization to the integer ``softmax`` / ``layernorm`` kernels
(``kernels._normalize`` states the integer pipelines).

What the exporter writes, and what is lowered:

* ``DequantizeLinear -> [Mul by a positive constant] -> Softmax -> ...``: quantbridge keeps the
  probabilities float (``torch._ops.KEEP_FLOAT_OUTPUT_OPS``), so the Softmax output feeds the
  float ``MatMul`` with the values, whose QuantizeLinear comes after. The program holds the
  probabilities as int16 codes of scale ``2**-15`` (zero point 0); the MatMul then multiplies
  int16 x 8-bit codes (int32 sums: a row of probabilities sums to at most ``2**15 + K/2``, so
  ``|acc| <= (2**15 + K/2) * 2**8`` for every length the softmax sum allows, K < 2**15). A QuantizeLinear directly after
  the Softmax (other exporters) requantizes those codes to its grid. The input must be an 8-bit
  tensor times an increasing affine function (the attention scale): softmax is shift-invariant,
  so only the slope per code, ``beta``, enters its exp table of code differences.
* ``MatMul(DQ a, DQ b) -> Softmax`` (scores with no QuantizeLinear: ``nn.MultiheadAttention``
  with ``need_weights=True``): the int32 accumulator is requantized inside the program to int16
  codes of a fine grid (``_scores_from_accumulator``), whose exp table stops where its entries
  round to 0; nothing in the QDQ model changes.
* ``DequantizeLinear -> LayerNormalization(scale, bias: float constants) -> QuantizeLinear``:
  one ``layernorm`` step realized at the QuantizeLinear (its (scale, zero point), and the clamp of
  any Relu / Clip in between). A LayerNormalization whose output stays float to a graph output
  is refused like every float output (``lower``'s error says to quantize it).
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from ...numerics import ISQRT_MAX, common_shift_multipliers, dequantize
from .._program import QTensor
from ..kernels._normalize import SOFTMAX_EXP_BITS, SOFTMAX_OUT_BITS
from ._core import (
    Builder,
    Elementwise,
    LoweringError,
    MaskedScores,
    Pending,
    QConst,
    QValue,
    SumPending,
    Value,
    accumulator_multiplier_bits,
    as_activation,
    as_const,
    attrs_of,
    describe_node,
    node_name,
    register_lowering,
)
from ._groupnorm import normalized
from ._linear import LinearPending
from ._qdq import float_result_codes

LAYERNORM_FRAC_BITS = 16  # fraction bits F of the normalized value T
# real units per code of scores requantized from an accumulator. Measured on
# nn.MultiheadAttention(need_weights=True) (tests/integer/test_integer_mha_scores.py), P @ V codes
# exactly as ORT: 2**-8 97.8%, 2**-10 99.5%, 2**-12 99.4% (the int16 probabilities limit it);
# 2**-10 makes a table of ~12k int32 entries (the exp reaches 0 at 17 ln 2 / 2**-10 codes).
SCORE_STEP = 2.0**-10


def _softmax_source(node: onnx.NodeProto, v: Value | None) -> tuple[QTensor, float]:
    """``(8-bit source tensor, beta)``: the Softmax input is ``a * r + c`` of the source's real
    values with ``a > 0``; ``beta = a * scale`` is the slope per code."""
    if isinstance(v, QValue) and not v.integer:
        t, fn = v.tensor, None
    elif isinstance(v, Elementwise):
        t, fn = v.source, v.fn
    else:
        raise LoweringError(
            f"{describe_node(node)}: its input must be a dequantized 8-bit tensor, optionally "
            "times a positive constant (DequantizeLinear -> [Mul] -> Softmax), or a MatMul of two "
            "quantized tensors; a float mask or another float computation in front of it has no "
            "integer lowering"
        )
    if t.bits > 8:
        raise LoweringError(f"{describe_node(node)}: a {t.bits}-bit input needs a "
                            f"{2**t.bits}-entry exp table; only 8-bit inputs are lowered")  # fmt: skip
    if fn is None:
        return t, t.scale
    codes = np.arange(t.qmin, t.qmax + 1, dtype=np.int64)
    r = (codes - t.zero_point) * np.float64(t.scale)
    with np.errstate(all="ignore"):
        f = np.asarray(fn(r), np.float64) * np.ones_like(r)
    slope = (f[-1] - f[0]) / (r[-1] - r[0])
    line = f[0] + slope * (r - r[0])
    if not (
        np.isfinite(f).all()
        and slope > 0
        and np.allclose(f, line, rtol=1e-9, atol=1e-12 * np.abs(f).max())
    ):
        raise LoweringError(
            f"{describe_node(node)}: its input is a non-linear or decreasing function of the "
            f"quantized tensor {t.name!r}; only an increasing affine one (a positive scale) is "
            "lowered to the exp table of code differences"
        )
    return t, float(slope * t.scale)


def _scores_from_accumulator(b: Builder, node: onnx.NodeProto, acc: LinearPending):
    """``(int16 score codes, beta)`` for a Softmax reading a MatMul of two activations that no
    QuantizeLinear follows (``nn.MultiheadAttention(need_weights=True)`` computes
    ``softmax(bmm(q * scale, k^T))``: placement leaves those scores float). The int32 accumulator
    is requantized inside the program to a grid of ``SCORE_STEP`` real units per code (the
    exponent's step: the exp table is then exact to a relative ``SCORE_STEP / 2`` per score,
    finer than any 8-bit grid of attention scores), coarser only where the accumulator bound
    would not fit int16 codes, never finer than one accumulator unit."""
    unit = float(acc.acc_scale.reshape(-1)[0])
    top = 2**15 - 1
    step = max(SCORE_STEP, unit, acc.acc_bound * unit / top)
    out = b.tensor(node_name(node) + "_scores", np.int16, step, 0)
    acc.realize(b, out, -top, top)
    return out, step


def _scores_from_sum(b: Builder, node: onnx.NodeProto, v: Pending) -> tuple[QTensor, float]:
    """``(int16 score codes, beta)`` for a Softmax reading an Add of quantized scores and a
    float constant (Swin / BEiT: ``scores + relative_position_bias``, the shifted windows' -100
    mask folded in; the constant is on a grid 256 times finer than the scores'): the sum is
    requantized once to ``SCORE_STEP`` real units per code, coarser only where
    ``bound`` would not fit int16 codes (error at most half a step per score)."""
    top = 2**15 - 1
    step = max(SCORE_STEP, float(v.bound) / top)
    out = b.tensor(node_name(node) + "_scores", np.int16, step, 0)
    v.realize(b, out, -top, top)
    return out, step


@register_lowering("Softmax")
def _softmax(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    v, keep, nan_keep = ins[0], [], None
    if isinstance(v, MaskedScores):  # masked scores get weight exactly 0 (as exp(-inf))
        v, keep, nan_keep = v.scores, [v.keep], (v.keep if v.nan_rows else None)
    if (isinstance(v, LinearPending) and v.acc_bound is not None and v.acc_scale is not None
            and v.acc_scale.size == 1):  # fmt: skip
        source, beta = _scores_from_accumulator(b, node, v)
    elif (isinstance(v, SumPending) or type(v) is Pending) and v.bound is not None:
        source, beta = _scores_from_sum(b, node, v)  # a sum moved by a Reshape: a Pending
    else:
        source, beta = _softmax_source(node, v)
    rank = len(b.shapes.get(node.input[0], ())) or None
    # before opset 13 the default axis is 1 and the input is flattened to 2-D from it: the same
    # as one softmax over the last axis exactly when that axis is the last one
    axis = int(attrs_of(node).get("axis", -1 if b.opset >= 13 else 1))
    last = axis == -1 or (rank is not None and axis % rank == rank - 1)
    if not last and (b.opset < 13 or rank is None or keep):
        raise LoweringError(f"{describe_node(node)}: softmax over axis {axis} of a rank-{rank} "
                            "tensor; only the last axis is lowered"
                            + (" (masked scores)" if keep else ""))  # fmt: skip
    k = b.dim(node.input[0], -1 if last else axis)
    if k is None:
        raise LoweringError(
            f"{describe_node(node)}: the softmax length of {node.input[0]!r} is unknown, so its "
            "int32 sum cannot be bounded; export with static shapes"
        )
    name = node_name(node)
    b.check_accumulator(name, float(k) * 2**SOFTMAX_EXP_BITS)
    # the table stops at the first difference whose entry rounds to 0 (or the code range)
    reach = math.floor((SOFTMAX_EXP_BITS + 1) * math.log(2) / beta) + 2
    d = np.arange(min(source.qmax - source.qmin + 1, reach), dtype=np.float64)
    table = np.rint(np.exp(-beta * d) * 2**SOFTMAX_EXP_BITS).astype(np.int64)
    out = b.tensor(node.output[0], np.int16, 2.0**-SOFTMAX_OUT_BITS, 0)
    if not last:  # the axis swapped with the last one, the kernel's rows, and back: codes moved
        perm = list(range(rank))
        perm[axis % rank], perm[-1] = perm[-1], perm[axis % rank]
        rows = b.like(source.name + "_rows", source)
        b.step("transpose", name, [source], rows, perm=tuple(perm))
        probs = b.like(out.name + "_rows", out)
        b.step("softmax", name, [rows], probs, table=table)
        b.step("transpose", name, [probs], out, perm=tuple(perm))
        return [QValue(out)]  # its rows are not along the last axis: no row_sum
    b.step("softmax", name, [source, *keep], out, table=table)
    # each p_j <= e_j 2**15 / S + 1/2: a row sums to at most 2**15 + K/2
    return [QValue(out, row_sum=2**SOFTMAX_OUT_BITS + (k + 1) // 2, nan_keep=nan_keep)]


def _normalized_length(b: Builder, node: onnx.NodeProto, axis: int) -> tuple[int, tuple]:
    shape = b.shapes.get(node.input[0])
    if shape is None:
        raise LoweringError(f"{describe_node(node)}: the input's rank is unknown")
    dims = tuple(shape[axis % len(shape) :])
    if any(d is None for d in dims):
        raise LoweringError(f"{describe_node(node)}: normalized dimensions {dims} must be static")
    return int(np.prod(dims, dtype=np.int64)), dims


def _pre_sqrt_shift(n: int, width: int, eps_codes: float) -> tuple[int, int]:
    """``(k, E)``: the largest ``k`` with ``V 4**k + E < 2**62`` for every row
    (``V <= N**2 width**2 / 4``), ``E = max(1, round(N**2 eps / s**2 * 4**k))``."""
    v_bound = n * n * width * width // 4 + 1
    k = max(0, (61 - v_bound.bit_length()) // 2)
    while True:
        e = max(1, round(n * n * eps_codes * 4.0**k))
        if v_bound * 4**k + e < ISQRT_MAX or k == 0:
            break
        k -= 1
    if v_bound * 4**k + e >= ISQRT_MAX:
        raise LoweringError(f"layer norm over {n} elements: epsilon / scale**2 = {eps_codes:.3g} "
                            "is too large for an int64 variance")  # fmt: skip
    return k, int(e)


def real_constant(node: onnx.NodeProto, v: Value | None, what: str) -> np.ndarray:
    """A float constant's values, or an integer constant's dequantized values (ONNX Runtime's
    QDQ files store LayerNormalization's scale as int8 and its bias as int32, each followed by a
    DequantizeLinear; the float op reads what the DequantizeLinear computes)."""
    if isinstance(v, QConst):
        return np.asarray(dequantize(v.q, v.scale, v.zero_point, v.axis))
    return np.asarray(as_const(node, v, what))


def layer_norm_input(b: Builder, node: onnx.NodeProto, v: Value | None) -> QTensor:
    """The codes a LayerNormalization reads. A float function of 8-bit codes (a GELU with no
    QuantizeLinear after it) goes through a table to int16 codes of ``max |f| / 32767``. A
    float result with a known bound on its real
    value (pre-LN transformers and ConvNeXt normalize the float residual sum ``x + f(x)``, or a
    pooled mean, that no QuantizeLinear follows) is realized first on a symmetric int16 grid
    of step ``bound / 32767``: half a step of error per element, about ``bound / 65534``, far
    below the output step for any row whose spread is above ``bound / 1000``."""
    codes = float_result_codes(b, node, v)  # wav2vec2 / WavLM: GELU -> Transpose -> LayerNorm
    return as_activation(node, v) if codes is None else codes


def layer_norm_values(
    node: onnx.NodeProto, x: QTensor, n: int, gamma: np.ndarray, beta: np.ndarray, eps: float
) -> tuple:
    """``(realize, bound)`` of the integer layer norm of rows of ``n`` codes of ``x``, times
    ``gamma`` plus ``beta`` per element. ``gamma`` / ``beta`` are flat, of a length ``P n`` that
    repeats every ``P`` rows (``P = 1``: a LayerNormalization; a group norm's per-channel affine
    differs per group: ``_groupnorm``). ``bound`` bounds the real output
    (``|x_hat_i| <= sqrt(N - 1)``)."""
    width = x.qmax - x.qmin
    k, e = _pre_sqrt_shift(n, width, eps / (x.scale * x.scale))
    frac = LAYERNORM_FRAC_BITS
    if (n * width).bit_length() + k + frac + 2 > 62:
        raise LoweringError(f"{describe_node(node)}: {n} elements of {x.bits}-bit codes overflow "
                            "the int64 normalization")  # fmt: skip
    t_bound = math.sqrt(n) * 2**frac + 1
    name = node_name(node)

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        ratios = gamma * 2.0**-frac / out.scale
        bits = accumulator_multiplier_bits(t_bound) - 1
        while True:
            if np.abs(ratios).max() > 0:
                m, shift = common_shift_multipliers(np.abs(ratios), bits)
                m = m * np.sign(ratios).astype(np.int64)
            else:
                m, shift = np.zeros(gamma.size, np.int64), 0
            offsets = np.rint(beta / out.scale * 2.0**shift)
            if np.abs(offsets).max() < 2.0**60 or bits <= 8:
                break
            bits -= 4  # a bias far larger than gamma: fewer multiplier bits keep B in int64
        if np.abs(offsets).max() >= 2.0**60:
            raise LoweringError(f"{describe_node(node)}: bias / scale ratio too large")
        builder.step("layernorm", name, [x], out, n=n, x_zero=x.zero_point, k=k, eps=e,
                     frac=frac, multipliers=m.astype(np.int64),
                     offsets=offsets.astype(np.int64), shift=int(shift),
                     out_zero=out.zero_point, qmin=qmin, qmax=qmax, dtype=out.dtype)  # fmt: skip

    return realize, float(np.max(np.abs(gamma) * math.sqrt(n) + np.abs(beta)))


@register_lowering("LayerNormalization")
def _layer_norm(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    x = layer_norm_input(b, node, ins[0])
    a = attrs_of(node)
    n, dims = _normalized_length(b, node, int(a.get("axis", -1)))
    gamma = np.broadcast_to(real_constant(node, ins[1], "scale").astype(np.float64), dims)
    beta = (np.broadcast_to(real_constant(node, ins[2], "bias").astype(np.float64), dims)
            if len(ins) > 2 and ins[2] is not None else np.zeros(dims))  # fmt: skip
    eps = float(a.get("epsilon", 1e-5))
    realize, bound = layer_norm_values(node, x, n, gamma.reshape(-1), beta.reshape(-1), eps)
    # a bound on the real output for a float graph output (_outputs)
    return [Pending(node_name(node), realize, bound=bound)]


@register_lowering("InstanceNormalization")
def _instance_norm(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """Each (batch, channel) row of ``n = prod(spatial)`` codes normalized by the layer norm
    step, times ``scale[c]`` plus ``bias[c]``: a ``Normalized`` value whose affine a following
    Mul / Add by constants (a group norm's gamma, beta) joins (``_groupnorm``)."""
    x = layer_norm_input(b, node, ins[0])
    shape = b.shapes.get(node.input[0])
    if shape is None or len(shape) < 3 or any(d is None for d in shape):
        raise LoweringError(f"{describe_node(node)}: the input shape must be static (got "
                            f"{shape}); export with static shapes or pass "
                            "lower(..., input_shapes=...)")  # fmt: skip
    channels, n = int(shape[1]), int(np.prod(shape[2:], dtype=np.int64))
    scale = np.broadcast_to(real_constant(node, ins[1], "scale").astype(np.float64), (channels,))
    bias = np.broadcast_to(real_constant(node, ins[2], "bias").astype(np.float64), (channels,))
    eps = float(attrs_of(node).get("epsilon", 1e-5))

    def make(gamma: np.ndarray, beta: np.ndarray):
        return layer_norm_values(node, x, n, gamma, beta, eps)

    return [
        normalized(node_name(node), np.repeat(scale, n), np.repeat(bias, n), make, shape, shape)
    ]
