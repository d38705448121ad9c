"""Lowering of Concat: of constants (shape arithmetic) folded, of index tensors as integers
(``_index``), of program tensors by one ``concat`` step that requantizes each part onto the
output grid; a float function of one 8-bit tensor (rotary embeddings' ``stack((-x2, x1))``) is
a table onto that grid and a pending result (torch.roll's Slice -> Concat of a Concat's slices)
its requantization there first (both elementwise: they commute with the concat)."""

from __future__ import annotations

import math

import numpy as np
import onnx

from ...numerics import fixed_point_multipliers
from .._program import QTensor
from ._core import (
    Builder,
    Const,
    Elementwise,
    IndexValue,
    IntInput,
    Pending,
    Value,
    attrs_of,
    node_name,
    quantize_real,
    register_lowering,
)
from ._eltwise import _operand
from ._index import integer_concat
from ._qdq import table_step


@register_lowering("Concat")
def _concat(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    axis = int(attrs_of(node)["axis"])
    if all(isinstance(v, Const) for v in ins):  # shape arithmetic: Shape -> Concat -> Expand
        return [Const(np.concatenate([v.array for v in ins], axis=axis))]
    if any(isinstance(v, IndexValue | IntInput) for v in ins):  # index pairs, not codes
        return integer_concat(b, node, ins)
    # a float function of one 8-bit tensor (rotary embeddings' stack((-x2, x1)): Neg of one
    # half) becomes a table straight onto the output's grid, then concatenated as it is
    # a pending result (torch.roll: Slice -> Concat of a Concat's slices) is requantized onto
    # the output grid first (requantization is elementwise: it commutes with the concat)
    parts = [v if isinstance(v, Elementwise | Pending) else _operand(b, node, v) for v in ins]
    name = node_name(node)

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        tensors = []
        for v in parts:
            if isinstance(v, Elementwise | Pending):
                t = builder.like(out.name + "_part", out)
                if isinstance(v, Elementwise):
                    table_step(builder, v.node, v.source, v.fn, t, qmin, qmax)
                else:
                    lo = qmin if v.lo == -math.inf else max(qmin, quantize_real(v.lo, out))
                    hi = qmax if v.hi == math.inf else min(qmax, quantize_real(v.hi, out))
                    v.realize(builder, t, lo, max(lo, hi))
                v = t
            tensors.append(v)
        multiplier, shift = fixed_point_multipliers([t.scale / out.scale for t in tensors])
        builder.step("concat", name, tensors, out, zeros=[t.zero_point for t in tensors],
                     multipliers=[int(m) for m in multiplier], shifts=[int(s) for s in shift],
                     axis=axis, out_zero=out.zero_point, qmin=qmin, qmax=qmax,
                     dtype=out.dtype)  # fmt: skip

    return [Pending(name, realize)]
