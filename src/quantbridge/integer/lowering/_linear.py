"""Lowering of Conv, ConvTranspose, Gemm, MatMul (QDQ form) and of QLinearConv, QLinearMatMul,
ConvInteger, MatMulInteger (integer ONNX operators) to the ``conv`` / ``conv_transpose`` /
``matmul`` kernels (``kernels._linear``: pipeline and bound stated there).

The accumulator bound of each layer is computed here from the integer weights and the input's
code range: ``max|q_x - z_x| * sum_k |q_w - z_w| + |q_b|`` per output channel (``K * range_a *
range_b`` for a product of two activations). A layer whose bound exceeds the accumulator
(int32 unless ``lower(..., accumulator_bits=64)``) is reported by name and lowering refuses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx

from ...numerics import fixed_point_multipliers
from .._program import QTensor
from ._core import (
    Accumulator,
    Builder,
    Const,
    Elementwise,
    LoweringError,
    Pending,
    QConst,
    QValue,
    Value,
    as_activation,
    as_qconst,
    attrs_of,
    code_range,
    describe_node,
    node_name,
    register_lowering,
)
from ._movement import moved
from ._unit_axis import lifted


def _per_channel(v: np.ndarray, channels: int, what: str, node: onnx.NodeProto) -> np.ndarray:
    v = np.asarray(v).reshape(-1)
    if v.size == 1:
        return np.repeat(v, channels)
    if v.size != channels:
        raise LoweringError(
            f"{describe_node(node)}: {what} has {v.size} values for {channels} channels"
        )
    return v


def _bias_codes(node, bias: QConst | None, acc_scale: np.ndarray) -> np.ndarray:
    """int32 bias codes in accumulator units (``s_x * s_w[c]``); rescaled offline (float64,
    rounded half to even) only when the file stores it with another scale, or quantized onto
    that grid the same way when the file keeps it float."""
    if bias is None:
        return np.zeros(acc_scale.shape, np.int64)
    if np.asarray(bias.q).dtype.kind == "f":  # a float bias (``_bias_operand``)
        real = _per_channel(bias.q, acc_scale.size, "bias", node).astype(np.float64)
        return np.round(real / acc_scale.astype(np.float64)).astype(np.int64)
    q = _per_channel(bias.q, acc_scale.size, "bias", node).astype(np.int64)
    s = _per_channel(bias.scale, acc_scale.size, "bias scale", node).astype(np.float64)
    z = _per_channel(bias.zero_point, acc_scale.size, "bias zero point", node).astype(np.int64)
    stored = (s.astype(np.float32) == acc_scale.astype(np.float32)) & (z == 0)
    if stored.all():
        return q
    return np.round((q - z) * s / acc_scale).astype(np.int64)


def linear(
    b: Builder,
    node: onnx.NodeProto,
    op: str,
    inputs: list[QTensor],
    acc_scale: np.ndarray,
    bound: np.ndarray,
    **attrs: Any,
) -> Pending:
    """The Pending of one linear layer: accumulator scale and bound per output channel; the
    requantization multipliers are chosen when the output's scale is known."""
    name = node_name(node)
    worst = float(np.max(bound))
    bits = b.check_accumulator(name, worst)

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        multiplier, shift = fixed_point_multipliers(acc_scale / out.scale, bits)
        builder.step(
            op, name, inputs, out, multiplier=multiplier, shift=shift, out_zero=out.zero_point,
            qmin=qmin, qmax=qmax, dtype=out.dtype, bound=worst, **attrs,
        )  # fmt: skip

    def write(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        ones = np.ones(acc_scale.size, np.int64)
        builder.step(
            op, name, inputs, out, multiplier=ones, shift=np.zeros_like(ones), out_zero=0,
            qmin=qmin, qmax=qmax, dtype=out.dtype, bound=worst, **attrs,
        )  # fmt: skip

    acc = Accumulator(acc_scale, -1 if op == "matmul" else 1, worst, write)
    if op != "matmul":
        return Pending(name, realize, accumulator=acc)

    def with_bias(add: onnx.NodeProto, codes: np.ndarray) -> Pending:
        biased = {**attrs, "bias": np.asarray(attrs["bias"], np.int64) + codes}
        return linear(b, add, op, inputs, acc_scale, bound + np.abs(codes), **biased)

    return LinearPending(name, realize, accumulator=acc, acc_scale=acc_scale, with_bias=with_bias,
                         acc_bound=worst)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LinearPending(Pending):
    """A MatMul's accumulator before its requantization, which a following ``Add`` of an int32
    bias (torch's export of a 3-D ``Linear``: ``MatMul -> Add(DequantizeLinear(bias))``) can
    still enter: ``with_bias(add_node, codes)`` is the layer with ``codes`` added."""

    acc_scale: np.ndarray | None = None
    with_bias: Callable[[onnx.NodeProto, np.ndarray], Pending] | None = None
    acc_bound: float | None = None  # max |accumulator| (a Softmax reading it picks its grid)


def scaled_accumulator(node: onnx.NodeProto, ins: list[Value | None]) -> LinearPending | None:
    """``Mul(acc, c)`` / ``Div(acc, c)`` of a weighted layer's accumulator and a positive scalar
    constant (Bloom's ``baddbmm(alibi, q, k^T, alpha=1/sqrt(d))``: ``(q @ k^T) * alpha``): the
    same accumulator with its scale times ``c`` (exact: ``c`` joins the requantization
    multiplier). None when ``ins`` is not that pattern."""
    if node.op_type not in ("Mul", "Div") or len(ins) != 2:
        return None
    for i, (acc, c) in enumerate((ins, ins[::-1])):
        if node.op_type == "Div" and i == 1:
            break  # c / acc is not a scaling
        if not (isinstance(acc, LinearPending) and acc.acc_scale is not None
                and isinstance(c, Const) and np.size(c.array) == 1
                and c.array.dtype.kind == "f"):  # fmt: skip
            continue
        factor = float(np.asarray(c.array, np.float64).reshape(()))
        factor = 1.0 / factor if node.op_type == "Div" else factor
        if not (factor > 0 and np.isfinite(factor)) or acc.lo != -np.inf or acc.hi != np.inf:
            return None
        return _scaled(acc, factor)
    return None


def _scaled(acc: LinearPending, factor: float) -> LinearPending:
    """``acc`` with every real value times ``factor > 0``: realized onto a grid ``factor``
    times finer (the same codes), its bias entry point scaled alike."""

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        acc.realize(builder, dataclasses.replace(out, scale=out.scale / factor), qmin, qmax)

    def with_bias(add: onnx.NodeProto, codes: np.ndarray) -> Pending:
        inner = acc.with_bias(add, codes)  # codes in accumulator units: the same integers
        return _scaled(inner, factor) if isinstance(inner, LinearPending) else inner

    a = acc.accumulator
    scaled = None if a is None else Accumulator(a.scale * factor, a.axis, a.bound, a.write)
    return LinearPending(acc.node, realize, accumulator=scaled, acc_scale=acc.acc_scale * factor,
                         with_bias=with_bias if acc.with_bias else None,
                         acc_bound=acc.acc_bound)  # fmt: skip


def add_bias(node: onnx.NodeProto, ins: list[Value | None]) -> Pending | None:
    """``MatMul -> Add(bias)`` with an integer bias along the last axis (``DequantizeLinear``
    of int32 codes): the bias joins the accumulator (rescaled offline, as ``_bias_codes``, when
    its scale is not the accumulator's), or a float bias the file keeps float
    (``nn.MultiheadAttention``'s packed ``in_proj_bias``, split: ``_bias_operand``). None when
    ``ins`` is not that pattern."""
    if node.op_type != "Add" or len(ins) != 2:
        return None
    for acc, bias in (ins, ins[::-1]):
        if isinstance(bias, Const) and bias.array.dtype.kind == "f" and bias.array.ndim <= 1:
            bias = _bias_operand(node, bias, "bias")
        if (isinstance(acc, LinearPending) and isinstance(bias, QConst) and bias.q.ndim <= 1
                and acc.lo == -np.inf and acc.hi == np.inf
                and bias.q.dtype.kind in "iuf"
                and np.asarray(bias.q).size in (1, acc.acc_scale.size)):  # fmt: skip
            codes = _bias_codes(node, bias, acc.acc_scale)
            return acc.with_bias(node, codes)
    return None


def _conv_geometry(node: onnx.NodeProto, weight: np.ndarray, transpose: bool) -> dict[str, Any]:
    a = attrs_of(node)
    spatial = weight.ndim - 2
    if spatial not in ((1, 2, 3) if not transpose else (2,)):
        raise LoweringError(f"{describe_node(node)}: {spatial}-D convolution is not lowered")
    auto_pad = a.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad not in ("NOTSET", "VALID"):
        raise LoweringError(f"{describe_node(node)}: auto_pad={auto_pad}; export explicit pads")
    geometry = {
        "strides": tuple(a.get("strides", [1] * spatial)),
        "pads": tuple(a.get("pads", [0] * 2 * spatial)),
        "dilations": tuple(a.get("dilations", [1] * spatial)),
        "group": int(a.get("group", 1)),
    }
    if transpose:
        if "output_shape" in a:
            raise LoweringError(f"{describe_node(node)}: output_shape is not lowered; use pads")
        geometry["output_padding"] = tuple(a.get("output_padding", [0] * spatial))
    return geometry


def conv(b, node, x: QTensor, xs: float, xz: int, w: QConst, bias: QConst | None) -> Pending:
    """Conv (weight (O, C/group, *K), parameters per output channel O) or ConvTranspose
    (weight (C, O/group, *K); per-channel parameters along axis 1, repeated per group)."""
    transpose = node.op_type in ("ConvTranspose",)
    geometry = _conv_geometry(node, w.q, transpose)
    weight, group = w.q, geometry["group"]
    channels = weight.shape[1] * group if transpose else weight.shape[0]
    w_scale = _group_tile(w.scale, channels, group, node).astype(np.float64)
    w_zero = _group_tile(w.zero_point, channels, group, node).astype(np.int64)
    if transpose:  # per output channel g * O/group + o: sum over C/group and the kernel
        grouped = weight.astype(np.int64).reshape(group, -1, *weight.shape[1:])
        zeros = w_zero.reshape(group, 1, -1, *([1] * (weight.ndim - 2)))
        w_sum = np.abs(grouped - zeros).sum(axis=(1, *range(3, weight.ndim + 1))).reshape(-1)
    else:
        zeros = w_zero.reshape(-1, *([1] * (weight.ndim - 1)))
        w_sum = np.abs(weight.astype(np.int64) - zeros).sum(axis=tuple(range(1, weight.ndim)))
    acc_scale = np.float64(xs) * w_scale
    bias_codes = _bias_codes(node, bias, acc_scale)
    bound = code_range(x, xz) * w_sum + np.abs(bias_codes)
    op = "conv_transpose" if transpose else "conv"
    return linear(b, node, op, [x], acc_scale, bound, x_zero=xz, weight=weight, w_zero=w_zero,
                  bias=bias_codes, **geometry)  # fmt: skip


def _group_tile(v, channels: int, group: int, node) -> np.ndarray:
    v = np.asarray(v).reshape(-1)
    if group > 1 and v.size * group == channels:
        return np.tile(v, group)
    return _per_channel(v, channels, "weight parameter", node)


@register_lowering("Conv", "ConvTranspose")
def _conv_qdq(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    if node.op_type == "ConvTranspose" and isinstance(ins[1], QConst) and np.ndim(ins[1].q) == 3:
        return lifted(b, node, ins, _conv_qdq)  # ConvTranspose1d: 2-D with a unit height
    x = as_activation(node, ins[0])
    w = as_qconst(node, ins[1], "the weight")
    bias = _bias_operand(node, ins[2], "the bias") if len(ins) > 2 and ins[2] is not None else None
    return [conv(b, node, x, x.scale, x.zero_point, w, bias)]


def _bias_operand(node: onnx.NodeProto, v: Value | None, what: str) -> QConst:
    """An int32 bias, or a float one: NNCF and ModelOpt quantize a layer's input and weight and
    keep its bias float. The accumulator grid ``s_x * s_w[c]`` is then the bias's grid, as for
    the engines that run such files (``_bias_codes`` rounds it there, half to even: at most half
    a step of the accumulator, far below one step of the output)."""
    if isinstance(v, Const) and v.array.dtype.kind == "f":
        return QConst(np.asarray(v.array, np.float64), np.ones(1), np.zeros(1, np.int64), None)
    return as_qconst(node, v, what)


def matmul_const(b, node, x: QTensor, xs: float, xz: int, w: QConst, bias) -> Pending:
    """``x @ W`` with a constant W (K, N), parameters per tensor or per column N."""
    if w.q.ndim != 2:
        raise LoweringError(f"{describe_node(node)}: weight has {w.q.ndim} dims; expected 2")
    if w.axis is not None and w.axis % 2 != 1:
        raise LoweringError(f"{describe_node(node)}: weight quantized along its reduction axis")
    channels = w.q.shape[1]
    w_scale = _per_channel(w.scale, channels, "weight scale", node).astype(np.float64)
    w_zero = _per_channel(w.zero_point, channels, "weight zero point", node).astype(np.int64)
    acc_scale = np.float64(xs) * w_scale
    bias_codes = _bias_codes(node, bias, acc_scale)
    w_sum = np.abs(w.q.astype(np.int64) - w_zero[None, :]).sum(axis=0)
    bound = code_range(x, xz) * w_sum + np.abs(bias_codes)
    return linear(b, node, "matmul", [x], acc_scale, bound, a_zero=xz, weight=w.q,
                  b_zero=w_zero, bias=bias_codes)  # fmt: skip


def matmul_act(
    b, node, a: QTensor, az: int, bt: QTensor, bz: int, acc_scale: float, row_sum=None,
    tops: tuple = (None, None),
) -> Pending:  # fmt: skip
    """``a @ b`` of two program tensors (attention scores, ...): scalar parameters; the bound
    uses K from ONNX shape inference (``K * range_a * range_b``), or ``row_sum * range_b`` when
    the rows of ``a`` have a known bound on ``sum |q - z|`` (softmax probabilities); ``tops``:
    the clamp of codes realized narrower than their dtype (``_bounded_operands``)."""
    k = b.dim(node.input[0], -1)
    if k is None and row_sum is None:
        raise LoweringError(
            f"{describe_node(node)}: the reduction length of {node.input[0]!r} is unknown, so "
            "its accumulator cannot be bounded; export with static shapes"
        )
    rows = k * (tops[0] or code_range(a, az)) if row_sum is None else row_sum
    bound = np.array([rows * (tops[1] or code_range(bt, bz))], dtype=np.float64)
    return linear(b, node, "matmul", [a, bt], np.array([acc_scale]), bound, a_zero=az,
                  b_zero=np.int64(bz), bias=np.zeros(1, np.int64))  # fmt: skip


def scaled_activation(node: onnx.NodeProto, v: Value | None) -> tuple[QTensor, float]:
    """``(tensor, c)`` for an operand ``c * dequantize(tensor)`` with a constant ``c > 0``
    (``scaled_dot_product_attention`` exports ``q * sqrt(scale)`` and ``k * sqrt(scale)``):
    ``c`` joins the accumulator scale. A plain dequantized tensor has ``c = 1``."""
    if isinstance(v, Elementwise):
        t = v.source
        r = (np.arange(t.qmin, t.qmax + 1, dtype=np.float64) - t.zero_point) * t.scale
        with np.errstate(all="ignore"):
            f = np.asarray(v.fn(r), np.float64) * np.ones_like(r)
        c = float(f[-1] / r[-1]) if r[-1] else 0.0
        if c > 0 and np.allclose(f, c * r, rtol=1e-9, atol=1e-12 * np.abs(f).max()):
            return t, c
    return as_activation(node, v), 1.0


def _constant_operand(b: Builder, node: onnx.NodeProto, v: Value | None) -> Value | None:
    """A per-tensor quantized constant as the first operand (a learned query: SigLIP's
    attention-pooling probe, ``probe.repeat(batch)`` quantized, times the query projection)
    becomes a program constant holding its codes; anything else is returned as it is."""
    if isinstance(v, QConst) and np.size(v.scale) == 1 and np.size(v.zero_point) == 1:
        t = b.constant(node.input[0], np.asarray(v.q), float(np.reshape(v.scale, ())),
                       int(np.reshape(v.zero_point, ())))  # fmt: skip
        return QValue(t)
    return v


def _float_weight_on_left(b: Builder, node: onnx.NodeProto, w: np.ndarray, x: QTensor) -> Value:
    """``W @ x`` with a float constant ``W`` (N, K) that the file keeps float on the left of a
    quantized ``x`` (..., K, L) (Mamba's ``dt_proj.weight @ x``, which placement leaves float):
    computed as ``(x^T @ W^T)^T`` with ``W`` on symmetric integer codes per output row N, of
    ``max |W[n]| / top`` with ``top = min(32767, (2**31 - 1) / (K max|q_x - z_x|))`` (the
    accumulator stays in int32). Error of the sum, before the output's rounding: at most
    ``K max|W[n]| max|x| / (2 top)``, about 2**-16 of the sum's reach at top = 32767: far
    below one 8-bit output step."""
    rank = len(b.shapes.get(node.input[1]) or ())
    if w.ndim != 2 or rank < 2:
        raise LoweringError(f"{describe_node(node)}: a float constant of rank {w.ndim} times a "
                            f"rank-{rank or '?'} tensor is not lowered")  # fmt: skip
    k = w.shape[1]
    top = int(min(2**15 - 1, (2**31 - 1) // max(1, k * code_range(x, x.zero_point))))
    peak = np.abs(w.astype(np.float64)).max(axis=1)
    scale = np.where(peak > 0, peak / top, 1.0)
    codes = np.clip(np.rint(w / scale[:, None]), -top, top).astype(
        np.int16 if top > 127 else np.int8
    )
    perm = {"perm": (*range(rank - 2), rank - 1, rank - 2)}
    xt = moved(b, node, QValue(x), "transpose", perm)
    wt = QConst(codes.T.copy(), scale, np.zeros(scale.size, np.int64), 1)
    y = matmul_const(b, node, xt.tensor, x.scale, x.zero_point, wt, None)
    return moved(b, node, y, "transpose", perm)


def _bounded_operands(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> tuple:
    """A MatMul operand that is a float result with a bound and no QuantizeLinear (swinv2_cr's
    cosine attention: ``F.normalize(q) @ F.normalize(k)^T``, each in [-1, 1]) realized on
    symmetric int16 codes of ``bound / top``, ``top`` the largest that keeps the int32
    accumulator (``K top_a top_b < 2**31``, ``top <= 32767``): half a step of error per
    element, ~2**-13 of the bound for K = 64."""
    bounded = [isinstance(v, Pending) and not isinstance(v, LinearPending) and v.bound is not None
               and math.isfinite(v.bound) and v.bound > 0 for v in ins[:2]]  # fmt: skip
    k = b.dim(node.input[0], -1)
    if not any(bounded) or k is None:
        return ins, (None, None)
    other = [None if f else v for v, f in zip(ins[:2], bounded, strict=True)]
    ranges = [code_range(v.tensor, v.tensor.zero_point) if isinstance(v, QValue) else None
              for v in other]  # fmt: skip
    out, tops = list(ins), [None, None]
    for i, v in enumerate(ins[:2]):
        if not bounded[i]:
            continue
        if all(bounded):
            top = min(2**15 - 1, math.isqrt((2**31 - 1) // k))
        else:
            top = min(2**15 - 1, (2**31 - 1) // (k * (ranges[1 - i] or 2**15)))
        codes = b.tensor(f"{node_name(node)}_operand{i}", np.int16, v.bound / top, 0)
        lo = -top if v.lo == -math.inf else max(-top, round(v.lo / codes.scale))
        hi = top if v.hi == math.inf else min(top, round(v.hi / codes.scale))
        v.realize(b, codes, lo, max(lo, hi))
        out[i], tops[i] = QValue(codes), top
    return out, tuple(tops)


@register_lowering("MatMul")
def _matmul_qdq(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    ins, tops = _bounded_operands(b, node, ins)
    if (isinstance(ins[0], Const) and ins[0].array.dtype.kind == "f"
            and isinstance(ins[1], QValue) and not ins[1].integer):  # fmt: skip
        return [_float_weight_on_left(b, node, np.asarray(ins[0].array), ins[1].tensor)]
    ins = [_constant_operand(b, node, ins[0]), *ins[1:]]
    a, ca = scaled_activation(node, ins[0])
    if isinstance(ins[1], QValue | Elementwise):
        (t, cb), row_sum = scaled_activation(node, ins[1]), getattr(ins[0], "row_sum", None)
        scale = a.scale * t.scale * ca * cb
        return [matmul_act(b, node, a, a.zero_point, t, t.zero_point, scale, row_sum, tops)]
    w = as_qconst(node, ins[1], "the second operand")
    return [matmul_const(b, node, a, a.scale * ca, a.zero_point, w, None)]


@register_lowering("Gemm")
def _gemm(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    a = attrs_of(node)
    if a.get("transA", 0) or a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0:
        raise LoweringError(f"{describe_node(node)}: only transA=0, alpha=beta=1 are lowered")
    x = as_activation(node, ins[0])
    w = as_qconst(node, ins[1], "B")
    bias = _bias_operand(node, ins[2], "C") if len(ins) > 2 and ins[2] is not None else None
    if a.get("transB", 0):
        w = QConst(w.q.T, w.scale, w.zero_point, None if w.axis is None else 1 - w.axis % 2)
    return [matmul_const(b, node, x, x.scale, x.zero_point, w, bias)]
