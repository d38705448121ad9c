"""Lowering of elementwise ops: Add / Sub / Mul by integer rescaling, Relu / Clip into
the requantization clamp, and float functions of one 8-bit tensor into exact lookup tables.

Rules, in the order a handler asks them:

1. every non-constant operand is a function of the same program tensor ``x`` (``x`` itself, or
   an ``Elementwise`` of it) and every constant is a scalar: the result is ``Elementwise(x, f)``
   with the composed float function (SiLU ``x * sigmoid(x)``, HardSwish written out, ``x / 6``);
   its QuantizeLinear turns it into a 256-entry table computed in float64;
2. Relu / Clip of a ``Pending`` kernel result: the clamp narrows (the requantization saturates);
   an integer Clip of codes (QuantizeLinear -> Clip -> DequantizeLinear: narrow range, sub-8-bit,
   uint8 after a ReLU) narrows the clamp of the step that wrote them, or is one identity
   ``rescale_sum`` with that clamp;
3. Add / Sub / Mul of program tensors (or integer constants) with any scales: a
   ``Pending`` realized as ``rescale_sum`` / ``mul`` with integer multipliers (Concat: ``_concat``);
   a float constant tensor added to one program tensor goes on a fine int32 grid first
   (``_float_constants_on_fine_grid``); a division by a tensor is ``_divide``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import onnx

from ...numerics import fixed_point_multiplier, quantize
from .._program import QTensor
from ._core import (
    Builder,
    Const,
    Elementwise,
    IndexValue,
    IntInput,
    LoweringError,
    MaskedScores,
    Pending,
    QConst,
    QValue,
    SumPending,
    Value,
    as_function,
    attrs_of,
    code_range,
    compose,
    describe_node,
    node_name,
    register_lowering,
)
from ._divide import accumulator_plus_constant, division
from ._groupnorm import Normalized, as_codes, as_operands, fold_affine, settled
from ._index import additive_mask, integer_arithmetic
from ._l2 import L2Norm
from ._linear import LinearPending, add_bias, scaled_accumulator
from ._qdq import float_result_codes, rescale_sum
from ._rms import CenteredSum, RowSquares, centered_source, centered_squares
from ._rms import compose as compose_row

Fn = Callable[[np.ndarray], np.ndarray]

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sigmoid(r: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * r))  # exact form without exp overflow


def _gelu(attrs: dict) -> Fn:
    if attrs.get("approximate", "none") in ("tanh", b"tanh"):
        return lambda r: 0.5 * r * (1 + np.tanh(math.sqrt(2 / math.pi) * (r + 0.044715 * r**3)))
    return lambda r: 0.5 * r * (1.0 + _erf(r / math.sqrt(2.0)))


def _hard_sigmoid(attrs: dict) -> Fn:
    alpha, beta = attrs.get("alpha", 0.2), attrs.get("beta", 0.5)
    return lambda r: np.clip(alpha * r + beta, 0.0, 1.0)


# ONNX unary ops as float64 functions of their input (attributes -> function)
UNARY: dict[str, Callable[[dict], Fn]] = {
    "Relu": lambda a: lambda r: np.maximum(r, 0.0),
    "Sigmoid": lambda a: _sigmoid,
    "Tanh": lambda a: np.tanh,
    "Exp": lambda a: np.exp,
    "Erf": lambda a: _erf,
    "Neg": lambda a: np.negative,
    "Abs": lambda a: np.abs,
    "Sqrt": lambda a: np.sqrt,
    "Reciprocal": lambda a: np.reciprocal,
    "Softplus": lambda a: lambda r: np.logaddexp(0.0, r),
    "HardSigmoid": _hard_sigmoid,
    "HardSwish": lambda a: lambda r: r * np.clip(r / 6.0 + 0.5, 0.0, 1.0),
    "LeakyRelu": lambda a: lambda r: np.where(r >= 0, r, a.get("alpha", 0.01) * r),
    "Gelu": _gelu,
    "Sin": lambda a: np.sin,
    "Cos": lambda a: np.cos,
}
BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": np.divide,
    "Pow": np.power,
}


def _fold_constants(op: str, a: np.ndarray, c: np.ndarray) -> np.ndarray:
    """ONNX's result in the operands' dtype (an integer Div truncates toward zero)."""
    a, c = np.asarray(a), np.asarray(c)
    if op == "Div" and a.dtype.kind in "iu":
        return np.asarray(np.trunc(a / c)).astype(a.dtype)
    return np.asarray(BINARY[op](a, c)).astype(a.dtype)


def _clip_bounds(node: onnx.NodeProto, ins: list[Value | None]) -> tuple[float, float]:
    a = attrs_of(node)
    lo, hi = a.get("min", -math.inf), a.get("max", math.inf)
    for i, v in enumerate(ins[1:3]):
        if v is None:
            continue
        if not isinstance(v, Const):
            raise LoweringError(f"{describe_node(node)}: Clip bounds must be constants")
        value = float(np.asarray(v.array).reshape(()))
        lo, hi = (value, hi) if i == 0 else (lo, value)
    return float(lo), float(hi)


@register_lowering("Relu", "Clip")
def _relu_clip(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    lo, hi = (0.0, math.inf) if node.op_type == "Relu" else _clip_bounds(node, ins)
    x = ins[0]
    if isinstance(x, L2Norm):  # F.normalize's clamp_min(eps) stays on the norm (``_divide``)
        return [dataclasses.replace(x, lo=max(x.lo, lo), hi=min(x.hi, hi))]
    if isinstance(x, Pending):
        return [Pending(x.node, x.realize, max(x.lo, lo), min(x.hi, hi), x.bound, x.accumulator)]
    if node.op_type == "Clip" and isinstance(x, QValue) and x.integer:
        return [_clamp_codes(b, node, x.tensor, lo, hi)]
    if node.op_type == "Clip" and isinstance(x, Const) and x.array.dtype.kind in "iu":
        # integer weight codes -> Clip -> DequantizeLinear (Brevitas's QCDQ export): the codes
        return [Const(np.clip(x.array, lo, hi).astype(x.array.dtype))]
    composed = compose(node, [x], lambda r: np.clip(r, lo, hi))
    if composed is None:
        raise LoweringError(f"{describe_node(node)}: input is not a quantized tensor")
    return [composed]


def _clamp_codes(b: Builder, node: onnx.NodeProto, t: QTensor, lo: float, hi: float) -> QValue:
    """``clip(q, lo, hi)`` on the codes of ``t``. When ``t`` was written for this Clip's input
    alone (by the QuantizeLinear in front of it), its step's clamp narrows:
    ``clip(clip(v, a, b), lo, hi) == clip(v, max(a, lo), min(b, hi))``; else an identity
    ``rescale_sum`` (multiplier ``2**n``, shift ``n``: exact) applies the clamp."""
    qmin = max(t.qmin, math.ceil(lo))
    qmax = max(qmin, min(t.qmax, math.floor(hi)))
    writer = next((i for i in range(len(b.steps) - 1, -1, -1) if b.steps[i].output == t.name), None)
    step = b.steps[writer] if writer is not None else None
    if (step is not None and "qmin" in step.attrs and t.name == node.input[0]
            and b.readers.get(node.input[0], 0) == 1):  # fmt: skip
        narrowed = {"qmin": max(qmin, step.attrs["qmin"]), "qmax": min(qmax, step.attrs["qmax"])}
        narrowed["qmax"] = max(narrowed["qmin"], narrowed["qmax"])
        b.steps[writer] = dataclasses.replace(step, attrs={**step.attrs, **narrowed})
        return QValue(t, integer=True)
    out = b.like(node.output[0], t)
    rescale_sum(b, node_name(node), [t], out, qmin, qmax)
    return QValue(out, integer=True)


@register_lowering(*[op for op in UNARY if op != "Relu"])
def _unary(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    fn = UNARY[node.op_type](attrs_of(node))
    v = ins[0]
    if isinstance(v, Normalized) or (isinstance(v, Pending) and v.bound and math.isfinite(v.bound)
                                     and not isinstance(v, SumPending)):  # fmt: skip
        # GroupNorm -> SiLU, ReduceSum -> Sigmoid: on int16 codes that hold every value
        ins = [as_codes(b, v)]
    if isinstance(ins[0], RowSquares):  # RMSNorm: sqrt / reciprocal of the mean square
        return [compose_row(ins[0], fn)]
    composed = compose(node, ins[:1], fn)
    if composed is None:
        raise LoweringError(
            f"{describe_node(node)}: lowered as a table, its input must be a quantized 8-bit "
            "tensor (DequantizeLinear -> op -> QuantizeLinear)"
        )
    return [composed]


def _operand(b: Builder, node: onnx.NodeProto, v: Value | None, i: int = -1) -> QTensor:
    if isinstance(v, QValue):
        return v.tensor
    if isinstance(v, QConst) and np.size(v.scale) == 1 and np.size(v.zero_point) == 1:
        zero = int(np.asarray(v.zero_point).reshape(()))
        scale = float(np.asarray(v.scale).reshape(()))
        return b.constant(node_name(node) + "_operand", v.q, scale, zero)
    if isinstance(v, Pending | Elementwise) and 0 <= i < len(node.input):
        what = (
            "quantbridge's export left it float (no integer lowering reads this pattern yet: "
            "please report it with the model); add a QuantizeLinear -> DequantizeLinear pair "
            if b.ours
            else "the tool that wrote the file left it float, as NNCF does with a BERT's "
            "attention inputs. Quantize it: re-quantize the float model with quantbridge "
            "(`quantbridge quantize FLOAT.onnx --calib CALIB.npz`, which quantizes every "
            "activation), or add a QuantizeLinear -> DequantizeLinear pair "
        )
        raise LoweringError(
            f"{describe_node(node)}: its input {node.input[i]!r} is a float value computed from "
            "quantized tensors with no QuantizeLinear before this op, and no bound on its range "
            f"is known here, so it has no integer codes; {what}on {node.input[i]!r}"
        )
    raise LoweringError(
        f"{describe_node(node)}: operands must be quantized tensors (or per-tensor quantized "
        "constants) unless all are functions of one tensor"
    )


@register_lowering("Add", "Sub", "Mul", "Div", "Pow")
def _binary(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    if any(isinstance(v, IndexValue | IntInput) for v in ins):  # ids, not quantized values
        return integer_arithmetic(b, node, ins)
    if all(isinstance(v, Const) for v in ins):  # shape arithmetic (DeBERTa: size * constant)
        return [Const(_fold_constants(node.op_type, *(v.array for v in ins)))]
    if (node.op_type == "Div" and isinstance(ins[1], Const) and ins[1].array.dtype.kind == "f"
            and ins[1].array.size > 1 and np.all(ins[1].array != 0)
            and isinstance(ins[0], Pending | QValue)):  # fmt: skip
        # x / counts (torch's decomposed adaptive average pool): x times 1 / counts, on the
        # int16 grid of a float factor (``_float_factor_on_int16_grid``)
        reciprocal = Const(1.0 / np.asarray(ins[1].array, np.float64))
        mul = onnx.helper.make_node("Mul", list(node.input), list(node.output), name=node.name)
        return _binary(b, mul, [ins[0], reciprocal])
    squares = centered_squares(node, ins)
    if squares is not None:  # a layer norm's variance written out: (x - mean(x))**2
        return [squares]
    centered = centered_source(node, ins)
    ins = settled(b, ins)
    folded = fold_affine(b, node, ins)  # a group norm's gamma, beta
    if folded is not None:
        return [folded]
    ins = as_operands(b, ins)
    rows = [v for v in ins if isinstance(v, RowSquares)]
    scalars = [v for v in ins if isinstance(v, Const) and np.size(v.array) == 1]
    if len(rows) == 1 and len(scalars) == 1 and len(ins) == 2:  # RMSNorm: + eps, 1 / ...
        c = np.float64(np.asarray(scalars[0].array).reshape(()))
        op = BINARY[node.op_type]
        first = isinstance(ins[0], RowSquares)
        return [compose_row(rows[0], (lambda m: op(m, c)) if first else (lambda m: op(c, m)))]
    masked = additive_mask(b, node, ins)  # scores + (0 / finfo.min mask): eager attention
    if masked is not None:
        return [masked]
    for i, v in enumerate(ins):  # T5: scores + Where(keep, position_bias, finfo.min)
        if (node.op_type == "Add" and len(ins) == 2 and isinstance(v, MaskedScores)
                and isinstance(v.scores, Const) and isinstance(ins[1 - i], QValue)):  # fmt: skip
            biased = _binary(b, node, [ins[1 - i], v.scores])[0]
            return [MaskedScores(biased, v.keep, node_name(node), v.nan_rows, v.fill)]
    composed = compose(node, _bounded_functions(b, node, ins), BINARY[node.op_type])
    if composed is not None:
        return [composed]
    biased = add_bias(node, ins)  # MatMul -> Add(int32 bias)
    if biased is not None:
        return [biased]
    scaled = scaled_accumulator(node, ins)  # Bloom: (q @ k^T) * alpha
    if scaled is not None:
        return [scaled]
    denominator = accumulator_plus_constant(b, node, ins)  # efficientvit: acc + eps
    if denominator is not None:
        return [denominator]
    ins = _float_sums_on_int16_grid(b, node, ins)
    ins = _float_constants_on_fine_grid(node, ins)
    ins = _float_factor_on_int16_grid(node, ins)
    ins = _accumulators_on_int16_grid(b, node, ins)
    ins = _float_constants_on_fine_grid(node, ins)  # a float constant added to those codes
    quotient = division(b, node, ins) if node.op_type == "Div" else None
    if quotient is not None:  # by a tensor: F.normalize, GRN (``_divide``)
        return [quotient]
    if node.op_type not in ("Add", "Sub", "Mul"):
        raise LoweringError(
            f"{describe_node(node)}: lowered only as a function of one 8-bit tensor and scalars"
        )
    bound = sum(_real_bound(v) for v in ins)
    a, c = _operand(b, node, ins[0], 0), _operand(b, node, ins[1], 1)
    name = node_name(node)
    if node.op_type == "Mul":
        return [_mul(b, name, a, c)]
    sign = 1 if node.op_type == "Add" else -1

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        rescale_sum(builder, name, [a, c], out, qmin, qmax, signs=(1, sign))

    bound = bound if math.isfinite(bound) else None
    if centered is not None:
        return [CenteredSum(name, realize, bound=bound, source=centered[0], n=centered[1])]
    return [SumPending(name, realize, bound=bound)]


def _real_bound(v: Value | None) -> float:
    """``max |real value|`` of a quantized constant (its codes), or over a tensor's code range."""
    if isinstance(v, QConst):
        real = (np.asarray(v.q, np.float64) - np.asarray(v.zero_point)) * np.asarray(v.scale)
        return float(np.abs(real).max()) if real.size else 0.0
    if isinstance(v, QValue):
        return v.tensor.scale * code_range(v.tensor, v.tensor.zero_point)
    return math.inf


def _float_constants_on_fine_grid(node: onnx.NodeProto, ins: list[Value | None]) -> list:
    """Add / Sub of one program tensor ``x`` and a float constant tensor (a ViT's position
    embedding, which the default recipe leaves unquantized): the constant as int32 codes on a
    grid 256 times finer than ``x``'s (coarser only where that would exceed 2**24 codes), so
    ``rescale_sum`` adds it with one rounding, as ONNX Runtime's float Add then QuantizeLinear
    do; the constant's own rounding error is at most ``s_x / 512``."""
    tensors = [v.tensor for v in ins if isinstance(v, QValue)]
    if node.op_type not in ("Add", "Sub") or len(tensors) != 1:
        return ins
    out = []
    for v in ins:
        if isinstance(v, Const) and v.array.dtype.kind == "f":
            c = np.asarray(v.array, np.float64)
            scale = np.float64(tensors[0].scale) / 256
            peak = float(np.abs(c).max()) / scale if c.size else 0.0
            scale *= max(1.0, peak / 2**24)
            q = quantize(c, scale, np.float64(0), -(2**31), 2**31 - 1)
            v = QConst(np.asarray(q).astype(np.int32), np.asarray(scale), np.asarray(0), None)
        out.append(v)
    return out


def _bounded_functions(
    b: Builder, node: onnx.NodeProto, ins: list[Value | None]
) -> list[Value | None]:
    """A float result with a bound (a LayerNormalization output that no QuantizeLinear follows:
    MambaOut's stem LN -> GELU) on int16 codes that hold every value (``as_codes``, as
    ``_unary`` does), when the other operand is a function of those codes, or a scalar that it
    divides or raises it by: GELU's ``x / sqrt 2`` and ``x * (...)`` then compose into one
    table on them. (Add / Sub / Mul by a scalar keep ``_float_sums_on_int16_grid``'s steps.)"""
    i = [j for j, v in enumerate(ins) if isinstance(v, Pending) and v.bound is not None
         and math.isfinite(v.bound) and v.bound > 0
         and not isinstance(v, SumPending | LinearPending)]  # fmt: skip
    if len(i) != 1 or len(ins) != 2:
        return ins
    v, other = ins[i[0]], as_function(ins[1 - i[0]])
    codes = b.realized.get(v.node)
    if other is None or other[0] is not None and (codes is None or other[0].name != codes.name):
        return ins
    if other[0] is None and node.op_type in ("Add", "Sub", "Mul"):
        return ins
    return [as_codes(b, v) if j == i[0] else w for j, w in enumerate(ins)]


def _float_sums_on_int16_grid(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list:
    """Add / Sub / Mul reading float results that no QuantizeLinear follows, each with a bound on its
    real value (NNCF's BERT: ``word[ids] + token_type[0] + position``, rows of int8 tables and a
    float table, then the first LayerNormalization, all float): each realized on symmetric int16
    codes of ``bound / 32767`` first (``float_result_codes``, the rule for every float result
    with a bound: half a step of error), then the usual rescaled sum (a float constant on its
    fine grid) or product (a float factor on its int16 grid: NNCF's SmoothQuant scale, or the
    gamma, of a float LayerNorm output). Weighted layers' accumulators:
    ``_accumulators_on_int16_grid``."""
    if node.op_type not in ("Add", "Sub", "Mul") or len(ins) != 2:
        return ins
    floats = [isinstance(v, Pending) and not isinstance(v, LinearPending)
              and v.bound is not None and math.isfinite(v.bound) and v.bound > 0 for v in ins]  # fmt: skip
    if not any(floats):
        return ins
    return [
        QValue(float_result_codes(b, node, v)) if f else v for v, f in zip(ins, floats, strict=True)
    ]


def _float_factor_on_int16_grid(node: onnx.NodeProto, ins: list[Value | None]) -> list:
    """Mul of one program tensor and a float constant tensor (ConvNeXt's layer scale ``gamma *
    x``, per channel, which the default recipe leaves float): the constant as symmetric int16
    codes of step ``max |c| / 32767``; the product's error is at most ``max |x| max |c| / 65534``,
    about 0.004 of an 8-bit output step spanning ``max |x| max |c|``."""
    if node.op_type != "Mul" or sum(isinstance(v, QValue) for v in ins) != 1:
        return ins
    out = []
    for v in ins:
        if isinstance(v, Const) and v.array.dtype.kind == "f" and v.array.size > 1:
            c = np.asarray(v.array, np.float64)
            peak = float(np.abs(c).max())
            scale = peak / 32767 if peak > 0 else 1.0
            q = quantize(c, np.float64(scale), np.float64(0), -32767, 32767)
            v = QConst(np.asarray(q).astype(np.int16), np.asarray(scale), np.asarray(0), None)
        out.append(v)
    return out


def _accumulators_on_int16_grid(b: Builder, node: onnx.NodeProto, ins: list) -> list:
    """Add / Sub of a MatMul of two activations that no QuantizeLinear follows and a quantized
    tensor (WavLM's ``baddbmm(position_bias, q, k^T)``): the int32 accumulator realized on
    int16 codes of one accumulator unit (exact) or, past 32767 units, of ``bound / 32767``
    (half of that per element), then the usual rescaled sum. A float constant tensor as the
    other operand (Bloom's ALiBi bias added to its scores) goes on its fine grid after."""
    others = [isinstance(v, QValue) or isinstance(v, Const) and v.array.dtype.kind == "f"
              and v.array.size > 1 for v in ins]  # fmt: skip
    if node.op_type not in ("Add", "Sub") or not any(others):
        return ins
    out = []
    for v in ins:
        if (isinstance(v, LinearPending) and v.acc_bound is not None
                and v.acc_scale is not None and v.acc_scale.size == 1):  # fmt: skip
            unit, top = float(v.acc_scale.reshape(-1)[0]), 2**15 - 1
            codes = b.tensor(node_name(node) + "_accumulator", np.int16,
                             max(unit, v.acc_bound * unit / top), 0)  # fmt: skip
            v.realize(b, codes, -top, top)
            v = QValue(codes)
        elif (type(v) is Pending and v.bound and math.isfinite(v.bound)
                and v.accumulator is None):  # fmt: skip
            v = as_codes(b, v)  # PoolFormer's pool(x) - x: the pool's mean on int16 codes
        out.append(v)
    return out


def _mul(b: Builder, name: str, a: QTensor, c: QTensor) -> Pending:
    bound = code_range(a, a.zero_point) * code_range(c, c.zero_point)
    bits = b.check_accumulator(name, bound)

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        multiplier, shift = fixed_point_multiplier(a.scale * c.scale / out.scale, bits)
        builder.step("mul", name, [a, c], out, zeros=[a.zero_point, c.zero_point],
                     multiplier=multiplier, shift=shift, out_zero=out.zero_point, qmin=qmin,
                     qmax=qmax, dtype=out.dtype)  # fmt: skip

    # |a c| <= range(a) range(c): a float graph output (Llama's final norm weight) on int16
    real = a.scale * code_range(a, a.zero_point) * c.scale * code_range(c, c.zero_point)
    return Pending(name, realize, bound=real)
