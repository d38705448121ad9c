"""Integer ONNX for the ``l2_normalize``, ``l2_norm`` and ``divide`` steps (``kernels._divide``
states the pipelines): int64 ReduceSum of squares, Newton's integer square root
(``_onnx_normalize._isqrt``), and ``numerics.divide_half_even`` as a flooring Div with the
remainder compared to half the divisor (ties to even through BitwiseAnd of the quotient)."""

from __future__ import annotations

import numpy as np
from onnx import helper

from ._onnx import _Graph, _register
from ._onnx_normalize import _isqrt


def _divide_half_even(g: _Graph, a: str, b: str) -> str:
    """``a / b`` rounded to nearest, ties to even, ``b > 0`` (``numerics.divide_half_even``)."""
    q = g.floor_div(a, b)
    r2 = g.op("Mul", [g.op("Sub", [a, g.op("Mul", [q, b])]), g.const(2)])
    odd = g.op("Equal", [g.op("BitwiseAnd", [q, g.const(1)]), g.const(1)])
    up = g.op("Or", [g.op("Greater", [r2, b]), g.op("And", [g.op("Equal", [r2, b]), odd])])
    return g.op("Add", [q, g.i64(up)])


def _root(g: _Graph, step, x: str) -> tuple[str, str]:
    """``(c, R)`` of ``kernels._divide.row_root``."""
    a = step.attrs
    c = g.centered(x, a["x_zero"])
    s2 = g.op("ReduceSum", [g.op("Mul", [c, c]), g.const(list(a["axes"]))], keepdims=1)
    w = g.op("Max", [g.op("Mul", [s2, g.const(4 ** a["k"])]), g.const(1)])
    zero = g.const(0)
    return c, g.op("Where", [g.op("Equal", [s2, zero]), zero, _isqrt(g, w)])


def _clip_cast(g: _Graph, step, y: str, out: str) -> None:
    a = step.attrs
    y = g.op("Clip", [y, g.const(a["qmin"]), g.const(a["qmax"])])
    g.op("Cast", [y], out, to=helper.np_dtype_to_tensor_dtype(np.dtype(a["dtype"])))


@_register("l2_normalize")
def _l2_normalize(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    c, r = _root(g, step, ins[0])
    e = g.const(a["eps"])
    d = g.op("Max", [r, e]) if a["eps_mode"] == "max" else g.op("Add", [r, e])
    d = g.op("Mul", [g.op("Max", [d, g.const(1)]), g.const(2 ** a["right"])])
    num = g.op("Mul", [c, g.const(a["multiplier"] * 2 ** a["left"])])
    y = g.op("Add", [_divide_half_even(g, num, d), g.const(a["out_zero"])])
    _clip_cast(g, step, y, out)


@_register("l2_norm")
def _l2_norm(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    _, r = _root(g, step, ins[0])
    if not a["keepdims"]:
        r = g.op("Squeeze", [r, g.const(list(a["axes"]))])
    g.requantize(r, step, a["multiplier"], a["shift"], (), out)


@_register("divide")
def _divide(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    num = g.op("Mul", [g.centered(ins[0], a["a_zero"]), g.const(a["multiplier"] * 2 ** a["left"])])
    den = g.op("Mul", [g.centered(ins[1], a["d_zero"]), g.const(2 ** a["right"])])
    zero = g.const(0)
    negative = g.op("Less", [den, zero])
    num = g.op("Where", [negative, g.op("Neg", [num]), num])
    den = g.op("Abs", [den])
    z = g.const(a["out_zero"])
    y = g.op("Add", [z, _divide_half_even(g, num, g.op("Max", [den, g.const(1)]))])
    sat = g.op("Where", [g.op("Greater", [num, zero]), g.const(a["qmax"]),
                         g.op("Where", [g.op("Less", [num, zero]), g.const(a["qmin"]), z])])  # fmt: skip
    y = g.op("Where", [g.op("Equal", [den, zero]), sat, y])
    _clip_cast(g, step, y, out)
