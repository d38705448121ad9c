"""A normalized value still float: ``InstanceNormalization``'s output (and so torch's
``nn.GroupNorm``, exported as ``Reshape(N, G, -1) -> InstanceNormalization(ones, zeros) ->
Reshape(N, C, H, W) -> Mul(gamma[C, 1, 1]) -> Add(beta[C, 1, 1])``) before its QuantizeLinear.

``Normalized`` is the integer layer norm (``_normalize.layer_norm_values``) of rows of ``n``
codes with a per-element affine ``gamma``, ``beta`` of a flat period ``P n`` (the pattern of one
batch item: a group's channels each repeat over H W elements, and groups differ), so:

* a Reshape / Flatten / Squeeze / Unsqueeze keeps it (the flat order does not change);
* a Mul / Add / Sub / Div by a float constant that is the same for every batch item folds into
  ``gamma`` / ``beta`` (the group norm's own affine) when that op is its only reader: one
  ``layernorm`` step, one rounding, at the QuantizeLinear;
* any other op on it (UNet / diffusion blocks: ``GroupNorm -> SiLU``, GELU, a residual Add; no
  QuantizeLinear in between) reads it realized once on a symmetric int16 grid of step ``bound / 32767``
  (``bound >= |gamma| sqrt(n - 1) + |beta|``, exact: no element saturates) through a
  65536-entry table; the extra rounding is at most ``bound / 65534`` real units per element.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx

from .._program import QTensor
from ._core import Builder, Const, Pending, QValue, Value, node_name


@dataclasses.dataclass(frozen=True, eq=False)
class Normalized(Pending):
    gamma: np.ndarray | None = None  # flat, one period (P n elements)
    beta: np.ndarray | None = None
    make: Callable | None = None  # (gamma, beta) -> (realize, bound)
    shape: tuple = ()  # of the ONNX tensor it stands for (static)
    source_shape: tuple = ()  # of the normalized rows (the InstanceNormalization's input)


def normalized(name: str, gamma: np.ndarray, beta: np.ndarray, make: Callable, shape: tuple,
               source_shape: tuple) -> Normalized:  # fmt: skip
    """The layer norm step writes the source's shape; a Reshape it went through comes after."""
    layer_norm, bound = make(gamma, beta)
    shape, source_shape = tuple(int(d) for d in shape), tuple(int(d) for d in source_shape)

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        if shape == source_shape:
            return layer_norm(builder, out, qmin, qmax)
        rows = builder.like(out.name + "_rows", out)
        layer_norm(builder, rows, qmin, qmax)
        builder.step("reshape", name + "_reshape", [rows], out, shape=shape)

    return Normalized(name, realize, bound=bound, gamma=gamma, beta=beta, make=make,
                      shape=shape, source_shape=source_shape)  # fmt: skip


def reshaped(v: Normalized, name: str, shape: tuple) -> Normalized:
    """``v`` after a movement that keeps the flat order (Reshape back to N, C, H, W)."""
    return normalized(name, v.gamma, v.beta, v.make, shape, v.source_shape)


def fold_affine(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> Normalized | None:
    """``Normalized op c`` (Mul / Add / Sub, either order) with ``c`` a float constant that
    repeats every batch item, as a new ``Normalized``; else None."""
    if node.op_type not in ("Mul", "Add", "Sub", "Div") or len(ins) != 2:
        return None
    i = next((j for j, v in enumerate(ins) if isinstance(v, Normalized)), None)
    c = ins[1 - i] if i is not None else None
    if not isinstance(c, Const) or c.array.dtype.kind != "f" or (node.op_type == "Div" and i):
        return None
    if b.readers.get(node.input[i], 0) > 1:  # GELU's x * (1 + erf(x / sqrt 2)): read twice
        return None
    v: Normalized = ins[i]
    shape = v.shape
    try:
        if np.broadcast_shapes(np.shape(c.array), tuple(shape)) != tuple(shape):
            return None
    except ValueError:
        return None
    rows = np.broadcast_to(np.asarray(c.array, np.float64), shape).reshape(-1, v.gamma.size)
    if not (rows == rows[0]).all():  # differs between batch items
        return None
    k, gamma, beta = rows[0], v.gamma, v.beta
    if node.op_type == "Mul":
        gamma, beta = gamma * k, beta * k
    elif node.op_type == "Div":
        gamma, beta = gamma / k, beta / k
    elif node.op_type == "Add":
        beta = beta + k
    elif i == 0:  # x - c
        beta = beta - k
    else:  # c - x
        gamma, beta = -gamma, k - beta
    return normalized(node_name(node), gamma, beta, v.make, shape, v.source_shape)


def as_codes(b: Builder, v: Pending) -> QValue:
    """``v`` realized once on a symmetric int16 grid that holds every value it can take."""
    if v.node not in b.realized:
        top = 2**15 - 1
        out = b.tensor(v.node + "_int16", np.int16, v.bound / top, 0)
        v.realize(b, out, -top, top)
        b.realized[v.node] = out
    return QValue(b.realized[v.node])


def settled(b: Builder, ins: list[Value | None]) -> list[Value | None]:
    """Operands with each ``Normalized`` already realized (by a function of it) as its codes:
    SiLU's ``x * sigmoid(x)`` reads the same int16 tensor twice."""
    return [as_codes(b, v) if isinstance(v, Normalized) and v.node in b.realized else v
            for v in ins]  # fmt: skip


def as_operands(b: Builder, ins: list[Value | None]) -> list[Value | None]:
    """Operands with each ``Normalized`` realized as its int16 codes: an op that its affine
    does not absorb (GELU's ``x / sqrt 2``, a residual ``x + norm(x)``) reads those."""
    return [as_codes(b, v) if isinstance(v, Normalized) else v for v in ins]
