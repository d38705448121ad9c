"""Lowering of divisions by a tensor to the ``l2_normalize`` and ``divide`` kernels
(``kernels._divide`` states the pipelines and the rounding).

Cases, in the order ``division`` asks them:

1. ``Div(x, ||x||)`` with the norm over the same codes ``x`` (``F.normalize``: ReduceL2 ->
   Clip(min=eps) -> Expand -> Div, swinv2_cr's cosine attention, vitamin; ONNX
   ``LpNormalization`` p=2): one ``l2_normalize`` step at the QuantizeLinear that reads it, the
   float model's ``eps`` in the denominator (``max``);
2. ``Div(a, d)`` of two tensors with no constant on either side (convnextv2's GRN
   ``||x|| / (mean ||x|| + eps)``): each operand as codes (a quantized tensor, a per-tensor
   quantized constant, or a float result with a bound realized on int16 codes as every float op
   reads one, ``_qdq.float_result_codes``), then one ``divide`` step at the QuantizeLinear;
3. the denominator ``acc + eps`` of efficientvit's linear attention (``q @ (k^T [v, 1])``, its
   last column ``q . sum_n k_n`` sliced off the unquantized MatMul result, plus ``eps``): the
   ``Add`` (``accumulator_plus_constant``) keeps the accumulator on an int32 grid of its own
   unit, exact, with ``eps`` in those units rounded up (so it stays > 0), and the ``divide``
   step reads those int32 codes.

A division by a float constant or of functions of one 8-bit tensor stays a table or a
multiplication (``_eltwise``); this module sees only what those leave.
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from ...numerics import fixed_point_multiplier
from .._program import QTensor
from ._core import (
    Builder,
    Const,
    Elementwise,
    LoweringError,
    Pending,
    QConst,
    QValue,
    Value,
    attrs_of,
    code_range,
    describe_node,
    node_name,
    register_lowering,
)
from ._l2 import L2Norm, l2_norm_value, root_shift
from ._qdq import float_result_codes, rescale_sum

LIMIT = 2**62  # each operand of the int64 division stays below it (divide_half_even's contract)


def _shifted_multiplier(node, real: float, num_max: float, den_max: float, k: int = 0) -> tuple:
    """``(M, L, P)`` with ``real 2**k ~= M 2**(L - P)``, the most bits (<= 30) that keep
    ``num_max M 2**L`` and ``den_max 2**P`` below ``2**62``."""
    for bits in range(30, 0, -1):
        m, n = fixed_point_multiplier(real, bits)
        left, right = max(k - n, 0), max(n - k, 0)
        if m and num_max * m * 2.0**left < LIMIT and den_max * 2.0**right < LIMIT:
            return m, left, right
    raise LoweringError(f"{describe_node(node)}: the quotient's scale ratio {real:.3g} does not "
                        "fit an int64 division; requantize its operands to closer scales")  # fmt: skip


def l2_normalized(b: Builder, node: onnx.NodeProto, x: QTensor, axes: tuple[int, ...], n: int,
                  eps: float, mode: str = "max") -> Pending:  # fmt: skip
    """``x / max(||x||, eps)`` (or ``/ (||x|| + eps)``) over ``axes``: an ``l2_normalize``
    step at the QuantizeLinear; the real result lies in [-1, 1]."""
    k, s2_max = root_shift(node, x, n)
    e = int(round(eps / x.scale * 2.0**k)) if eps > 0 else 0
    den_max = math.isqrt(s2_max << (2 * k)) + 1 + e
    name = node_name(node)

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        m, left, right = _shifted_multiplier(node, 1.0 / out.scale, code_range(x, x.zero_point),
                                             den_max, k)  # fmt: skip
        builder.step("l2_normalize", name, [x], out, axes=axes, x_zero=x.zero_point, k=k,
                     eps=e, eps_mode=mode, multiplier=m, left=left, right=right,
                     out_zero=out.zero_point, qmin=qmin, qmax=qmax, dtype=out.dtype)  # fmt: skip

    return Pending(name, realize, bound=1.0)


def _same_norm(num: Value | None, den: Value | None) -> bool:
    return (isinstance(num, QValue) and not num.integer and isinstance(den, L2Norm)
            and den.source is not None and den.source.name == num.tensor.name
            and den.keepdims and den.hi == math.inf)  # fmt: skip


def _codes(b: Builder, node: onnx.NodeProto, v: Value | None, i: int) -> QTensor:
    """The codes a division reads for operand ``i`` (module docstring, case 2)."""
    if isinstance(v, QValue):
        return v.tensor
    if isinstance(v, QConst) and np.size(v.scale) == 1 and np.size(v.zero_point) == 1:
        return b.constant(node_name(node) + "_operand", v.q, float(np.ravel(v.scale)[0]),
                          int(np.ravel(v.zero_point)[0]))  # fmt: skip
    codes = float_result_codes(b, node, v) if isinstance(v, Pending | Elementwise) else None
    if codes is not None:
        return codes
    raise LoweringError(
        f"{describe_node(node)}: its input {node.input[i]!r} has no integer codes (a float value "
        "with no QuantizeLinear and no known bound); add a QuantizeLinear -> DequantizeLinear "
        f"pair on {node.input[i]!r}"
        + (
            " (quantbridge's export left it float: please report the model)"
            if b.ours
            else ", or quantize the float model with quantbridge, which quantizes every activation"
        )
    )


INT32_TOP = 2**31 - 1


def accumulator_plus_constant(
    b: Builder, node: onnx.NodeProto, ins: list[Value | None]
) -> Value | None:
    """``Add(acc, c)`` of a MatMul accumulator that no QuantizeLinear follows (moved by a Slice,
    ...: ``Pending.accumulator``, one scale ``u``) and a float scalar ``c > 0`` (a denominator's
    eps): the accumulator realized exactly as int32 codes of ``u / 2**s`` (``acc << s``, ``s``
    the most that keeps ``bound 2**s + e`` in int32), then ``e = ceil(c 2**s / u)`` added by an
    exact ``rescale_sum``. The denominator is then at most ``u / 2**s`` above the float
    model's, and never 0 where the float one is ``eps``. None when ``ins`` is not that."""
    if node.op_type != "Add" or len(ins) != 2:
        return None
    for v, c in (ins, ins[::-1]):
        if (isinstance(v, Pending) and v.accumulator is not None and isinstance(c, Const)
                and np.size(v.accumulator.scale) == 1 and np.size(c.array) == 1
                and c.array.dtype.kind == "f"
                and float(np.ravel(c.array)[0]) > 0):  # fmt: skip
            break
    else:
        return None
    unit, eps = float(np.ravel(v.accumulator.scale)[0]), float(np.ravel(c.array)[0])
    bound = max(v.accumulator.bound, 1.0)
    s = max(0, math.floor(math.log2(INT32_TOP / (bound + 1))))
    while s > 0 and bound * 2**s + math.ceil(eps * 2**s / unit) > INT32_TOP:
        s -= 1
    e = max(1, math.ceil(eps * 2**s / unit))
    if bound * 2**s + e > INT32_TOP:
        return None
    name = node_name(node)
    acc = b.tensor(name + "_accumulator", np.int32, unit / 2**s, 0)
    lo = -INT32_TOP if v.lo == -math.inf else max(-INT32_TOP, math.ceil(v.lo / acc.scale))
    hi = INT32_TOP if v.hi == math.inf else min(INT32_TOP, math.floor(v.hi / acc.scale))
    v.realize(b, acc, lo, max(lo, hi))
    out = b.like(name, acc)
    rescale_sum(b, name, [acc, b.constant(name + "_eps", np.array(e, np.int32), acc.scale, 0)],
                out, -INT32_TOP, INT32_TOP)  # fmt: skip
    return QValue(out)


def _divide(b: Builder, node: onnx.NodeProto, a: QTensor, d: QTensor) -> Pending:
    name = node_name(node)
    range_a, range_d = code_range(a, a.zero_point), code_range(d, d.zero_point)

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        m, left, right = _shifted_multiplier(node, a.scale / (d.scale * out.scale), range_a,
                                             range_d)  # fmt: skip
        builder.step("divide", name, [a, d], out, a_zero=a.zero_point, d_zero=d.zero_point,
                     multiplier=m, left=left, right=right, out_zero=out.zero_point,
                     qmin=qmin, qmax=qmax, dtype=out.dtype)  # fmt: skip

    return Pending(name, realize)


def division(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> Value | None:
    """The lowering of ``Div(num, den)`` by a tensor (module docstring), None for a division
    that ``_eltwise`` lowers (by a constant, or of functions of one 8-bit tensor)."""
    num, den = ins
    if _same_norm(num, den):
        eps = den.lo if den.lo > 0 else 0.0
        return l2_normalized(b, node, num.tensor, den.axes, den.n, eps)
    if not isinstance(den, QValue | QConst | Pending | Elementwise):
        return None
    return _divide(b, node, _codes(b, node, num, 0), _codes(b, node, den, 1))


@register_lowering("LpNormalization")
def _lp_normalization(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """ONNX ``LpNormalization`` with ``p = 2``: ``x / ||x||`` along ``axis`` (no eps: a zero
    row gives 0 here, 0 / 0 in float)."""
    a = attrs_of(node)
    if int(a.get("p", 2)) != 2 or not isinstance(ins[0], QValue):
        raise LoweringError(f"{describe_node(node)}: only p=2 of a quantized tensor is lowered "
                            f"(got p={a.get('p', 2)}); an L1 normalization has no integer "
                            "kernel here: write it as x / ReduceL1(x) in float outside the "
                            "program")  # fmt: skip
    norm = l2_norm_value(b, node, ins[0].tensor, [int(a.get("axis", -1))], True)
    return [l2_normalized(b, node, ins[0].tensor, norm.axes, norm.n, 0.0)]
