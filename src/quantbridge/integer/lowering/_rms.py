"""Lowering of a function of a row's mean square: RMSNorm's ``rsqrt(mean(x**2) + eps)``
(Llama, Mistral, Qwen2, T5: ``Pow(x, 2) -> ReduceMean(-1) -> Add(eps) -> Sqrt -> Reciprocal ->
QuantizeLinear``; the recipe quantizes the reciprocal because a Mul reads it, and ``x * r``,
``* weight`` are then integer multiplies).

``RowSquares`` holds ``f(m)`` with ``m = s**2 S2 / N`` the real mean square of the row's N codes
(``S2 = sum (q - z)**2``, exact in int64). Unary ops and scalar arithmetic compose into ``f``.
At the QuantizeLinear, ``code(S2) = quantize(f(s**2 S2 / N))`` (float64) is monotone in ``S2``
when ``f`` is (checked at every breakpoint), so the program stores the integer values of ``S2``
where the code steps (at most 2**bits - 1 thresholds, found by bisection) and counts the
thresholds at or below ``S2`` (``kernels._normalize.row_squares``): exact against float64,
within 1 LSB of ONNX Runtime's float32 chain (a code apart only where float32 rounds across a
step).

A layer norm written out with its variance as a function (Cohere: ``d = x - mean(x)``,
``rsqrt(mean(d**2) + eps)`` quantized, then ``d * r``): ``Sub(x, ReduceMean(x))`` is a
``CenteredSum`` (realized as the usual rescaled sum where a QuantizeLinear reads it),
``Pow(d, 2)`` of it ``CenteredSquares``, and their ``ReduceMean`` a centered ``RowSquares``:
``S2 = N sum (q - z)**2 - (sum (q - z))**2 = N**2 var / s**2``, exact in int64, the real
variance ``s**2 S2 / N**2``; the same thresholds follow."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx

from ...numerics import quantize
from .._program import QTensor
from ._core import (
    Builder,
    Const,
    Elementwise,
    LoweringError,
    Pending,
    QValue,
    SumPending,
    Value,
    code_range,
    describe_node,
    node_name,
)


@dataclasses.dataclass(frozen=True)
class RowMean(Pending):
    """``ReduceMean`` of an 8-bit tensor's codes over its last axis (keepdims), before its
    QuantizeLinear: ``source`` and ``n`` let ``Sub(x, mean(x))`` be recognised as centered."""

    source: QTensor | None = None
    n: int = 0


@dataclasses.dataclass(frozen=True)
class RowSquares:
    source: QTensor
    n: int
    fn: Callable[[np.ndarray], np.ndarray]  # of the real mean square m
    node: str
    centered: bool = False  # m is the row's variance (``CenteredSquares``' mean)


@dataclasses.dataclass(frozen=True)
class CenteredSquares:
    """``(x - mean(x))**2`` of an 8-bit tensor's codes along its last axis (``n`` elements),
    waiting for the ReduceMean that makes it a variance."""

    source: QTensor
    n: int
    node: str


@dataclasses.dataclass(frozen=True)
class CenteredSum(SumPending):
    """``x - mean(x)`` along the last axis of ``source`` (``n`` elements): realized as the
    rescaled sum where a QuantizeLinear reads it; squared, the rows' variance (``_rms``)."""

    source: QTensor | None = None
    n: int = 0


def centered_source(node: onnx.NodeProto, ins: list[Value | None]) -> tuple | None:
    """``(x, n)`` for ``Sub(x, ReduceMean(x))`` over the last axis of the 8-bit tensor x."""
    if node.op_type != "Sub" or len(ins) != 2:
        return None
    x, mean = ins
    if (isinstance(x, QValue) and not x.integer and isinstance(mean, RowMean)
            and mean.source is not None and mean.source.name == x.tensor.name):  # fmt: skip
        return x.tensor, mean.n
    return None


def centered_squares(node: onnx.NodeProto, ins: list[Value | None]) -> CenteredSquares | None:
    """``Pow(x - mean(x), 2)`` (``CenteredSum``, exponent the constant 2), else None."""
    if node.op_type != "Pow" or len(ins) != 2 or not isinstance(ins[0], CenteredSum):
        return None
    e = ins[1]
    if not (isinstance(e, Const) and np.size(e.array) == 1 and float(np.ravel(e.array)[0]) == 2):
        return None
    return CenteredSquares(ins[0].source, ins[0].n, node_name(node))


def mean_of_squares(b: Builder, node: onnx.NodeProto, v, axes, keepdims: bool):
    """``ReduceMean(x**2)`` over the last axis (keepdims) of an 8-bit tensor, or None; of
    ``CenteredSquares``, the row's variance."""
    if not isinstance(v, Elementwise | CenteredSquares) or not keepdims:
        return None
    rank = len(b.shapes.get(node.input[0]) or ())
    n = b.dim(node.input[0], -1)
    if not rank or n is None or list(axes) != [rank - 1]:
        return None
    if isinstance(v, CenteredSquares):
        if v.n != n:
            return None
        return RowSquares(v.source, int(n), lambda m: m, node_name(node), centered=True)
    t = v.source
    r = (np.arange(t.qmin, t.qmax + 1, dtype=np.float64) - t.zero_point) * t.scale
    with np.errstate(all="ignore"):
        f = np.asarray(v.fn(r), np.float64) * np.ones_like(r)
    if not np.allclose(f, r * r, rtol=1e-6, atol=1e-12 * max(1.0, float((r * r).max()))):
        return None
    return RowSquares(t, int(n), lambda m: m, node_name(node))


def compose(v: RowSquares, fn: Callable[[np.ndarray], np.ndarray]) -> RowSquares:
    inner = v.fn
    return RowSquares(v.source, v.n, lambda m: fn(inner(m)), v.node, v.centered)


def realize(b: Builder, node: onnx.NodeProto, v: RowSquares, out: QTensor) -> None:
    t = v.source
    if v.centered:  # N**2 var <= N**2 (qmax - qmin)**2 / 4
        top = v.n * v.n * (t.qmax - t.qmin) ** 2 // 4
        step = np.float64(t.scale) ** 2 / (v.n * v.n)
    else:
        width = code_range(t, t.zero_point)
        top = v.n * width * width  # S2 in [0, top]
        step = np.float64(t.scale) ** 2 / v.n

    def code(s2: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            real = np.asarray(v.fn(s2.astype(np.float64) * step), np.float64)
        return np.asarray(quantize(real, np.float64(out.scale), np.float64(out.zero_point),
                                   out.qmin, out.qmax), np.int64)  # fmt: skip

    first, last = (int(c) for c in code(np.array([0, top])))
    sign = 1 if last >= first else -1
    targets = np.arange(first + sign, last + sign, sign, dtype=np.int64)
    lo, hi = np.zeros(targets.size, np.int64), np.full(targets.size, top + 1, np.int64)
    while np.any(lo < hi):  # the least S2 whose code has reached each target
        mid = (lo + hi) // 2
        reached = sign * (code(mid) - targets) >= 0
        hi, lo = np.where(reached, mid, hi), np.where(reached, lo, mid + 1)
    probe = np.unique(np.concatenate([lo, lo - 1, [0, top]]).clip(0, top))
    steps = first + sign * np.searchsorted(lo, probe, side="right")
    if not np.array_equal(steps, code(probe)):
        raise LoweringError(f"{describe_node(node)}: {v.node!r}'s function of the row's mean "
                            "square is not monotone; only monotone ones are lowered")  # fmt: skip
    b.step("row_squares", v.node, [t], out, x_zero=t.zero_point, thresholds=lo, base=first,
           sign=sign, dtype=out.dtype, centered=v.centered)  # fmt: skip
