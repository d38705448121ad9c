"""Integer ONNX for the ``softmax`` and ``layernorm`` steps (``kernels._normalize`` states the
pipelines), registered in the ONNX emitter's table: int64 ReduceMax / ReduceSum, Gather of the
exp table, Mul / Add / Sub, the flooring Div of ``_Graph.floor_div``, and Newton's integer square
root unrolled (``numerics.isqrt_newton``: start ``2**c`` with ``c`` a ReduceSum of comparisons
with ``4**j``, then ``ISQRT_STEPS`` times ``Min(x, (x + w / x) / 2)``)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ...numerics._intmath import ISQRT_STEPS
from ..kernels._normalize import SOFTMAX_OUT_BITS
from ._onnx import _Graph, _register


def _round_div(g: _Graph, a: str, b: str) -> str:
    """``floor((2a + b) / (2b))`` (``numerics.round_divide``)."""
    two = g.const(2)
    return g.floor_div(g.op("Add", [g.op("Mul", [a, two]), b]), g.op("Mul", [b, two]))


def _isqrt(g: _Graph, w: str) -> str:
    powers = g.const(np.int64(4) ** np.arange(32, dtype=np.int64))
    above = g.op("GreaterOrEqual", [g.op("Unsqueeze", [w, g.const([-1])]), powers])
    c = g.op("ReduceSum", [g.i64(above), g.const([-1])], keepdims=0)
    x = g.op("Gather", [g.const(np.left_shift(np.int64(1), np.arange(33, dtype=np.int64))), c])
    two = g.const(2)
    for _ in range(ISQRT_STEPS):
        step = g.op("Div", [g.op("Add", [x, g.op("Div", [w, x])]), two])  # positive: floor
        x = g.op("Min", [x, step])
    return x


def _masked_weights(g: _Graph, x: str, mask: str, table: np.ndarray) -> str:
    """``e`` of ``kernels._normalize._masked_softmax``: the mask broadcast to the scores as
    ``x * 0 + keep``, rows with none kept (``full``) uniform."""
    last, zero = g.const([-1]), g.const(0)
    kept = g.op("Add", [g.op("Mul", [x, zero]), g.i64(mask)])
    full = g.op("Equal", [g.op("ReduceMax", [kept, last], keepdims=1), zero])
    keep = g.op("Or", [g.op("Cast", [kept], to=TensorProto.BOOL), full])
    low = g.const(np.iinfo(np.int64).min)
    top = g.op("ReduceMax", [g.op("Where", [keep, x, low]), last], keepdims=1)
    d = g.op("Min", [g.op("Sub", [top, x]), g.const(len(table) - 1)])
    d = g.op("Where", [g.op("And", [keep, g.op("Not", [full])]), d, zero])
    return g.op("Where", [keep, g.op("Gather", [g.const(table), d], axis=0), zero])


@_register("softmax")
def _softmax(g: _Graph, step, ins: list[str], out: str) -> None:
    x = g.i64(ins[0])
    last = g.const([-1])
    table = np.asarray(step.attrs["table"], np.int64)
    if len(ins) > 1:
        e = _masked_weights(g, x, ins[1], table)
    else:
        d = g.op("Sub", [g.op("ReduceMax", [x, last], keepdims=1), x])
        d = g.op("Min", [d, g.const(len(table) - 1)])  # a table shorter than the code range
        e = g.op("Gather", [g.const(table), d], axis=0)
    total = g.op("ReduceSum", [e, last], keepdims=1)
    p = _round_div(g, g.op("Mul", [e, g.const(2**SOFTMAX_OUT_BITS)]), total)
    p = g.op("Min", [p, g.const(2**SOFTMAX_OUT_BITS - 1)])
    g.op("Cast", [p], out, to=TensorProto.INT16)


@_register("layernorm")
def _layernorm(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    n = a["n"]
    c = g.op("Reshape", [g.centered(ins[0], a["x_zero"]), g.const([-1, n])])
    axis = g.const([1])
    s1 = g.op("ReduceSum", [c, axis], keepdims=1)
    s2 = g.op("ReduceSum", [g.op("Mul", [c, c]), axis], keepdims=1)
    v = g.op("Sub", [g.op("Mul", [s2, g.const(n)]), g.op("Mul", [s1, s1])])
    w = g.op("Add", [g.op("Mul", [v, g.const(4 ** a["k"])]), g.const(a["eps"])])
    root = _isqrt(g, w)
    d = g.op("Sub", [g.op("Mul", [c, g.const(n)]), s1])
    t = _round_div(g, g.op("Mul", [d, g.const(2 ** (a["k"] + a["frac"]))]), root)
    if np.size(a["multipliers"]) != n:  # the affine repeats every P rows (a group norm)
        t = g.op("Reshape", [t, g.const([-1, np.size(a["multipliers"])])])
    acc = g.op("Add", [g.op("Mul", [t, g.const(a["multipliers"])]), g.const(a["offsets"])])
    y = g.requantize(acc, step, 1, a["shift"], (), g.name("layernorm"))
    g.op("Reshape", [y, g.const(list(g.shapes[step.output]))], out)


@_register("row_squares")
def _row_squares(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    c = g.centered(ins[0], a["x_zero"])
    s2 = g.op("ReduceSum", [g.op("Mul", [c, c]), g.const([-1])], keepdims=1)
    if a.get("centered", False):  # N S2 - S1**2
        s1 = g.op("ReduceSum", [c, g.const([-1])], keepdims=1)
        n = g.shapes[step.inputs[0]][-1]
        s2 = g.op("Sub", [g.op("Mul", [s2, g.const(n)]), g.op("Mul", [s1, s1])])
    thresholds = np.asarray(a["thresholds"], np.int64)
    if thresholds.size:
        reached = g.op("Cast", [g.op("LessOrEqual", [g.const(thresholds), s2])],
                       to=TensorProto.INT64)  # fmt: skip
        count = g.op("ReduceSum", [reached, g.const([-1])], keepdims=1)
    else:
        count = g.op("Mul", [s2, g.const(0)])
    code = g.op("Add", [g.op("Mul", [count, g.const(a["sign"])]), g.const(a["base"])])
    g.op("Cast", [code], out, to=helper.np_dtype_to_tensor_dtype(np.dtype(a["dtype"])))
