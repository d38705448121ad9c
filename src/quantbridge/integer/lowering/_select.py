"""``Where`` of a quantized tensor and a float scalar that lies on its grid
(``masked_fill(mask, 0.0)``: UperNet's decomposed adaptive average pool): a selection of codes,
no rescale."""

from __future__ import annotations

import numpy as np
import onnx

from ._core import Builder, Const, QValue, node_name


def fill_on_grid(b: Builder, node: onnx.NodeProto, keep, x, y) -> QValue | None:
    """``Where(cond, c, DQ(q))`` or ``Where(cond, DQ(q), c)`` with a float scalar ``c`` on the
    grid of ``q`` (``masked_fill(mask, 0.0)``: 0 is the code ``z``): a ``where`` step on the
    codes, the same grid, exact. ``keep()`` makes the condition's program tensor. None for any
    other operands."""
    for t, c, first in ((y, x, False), (x, y, True)):
        if not (isinstance(t, QValue) and not t.integer and isinstance(c, Const)
                and c.array.dtype.kind == "f" and c.array.size == 1):  # fmt: skip
            continue
        q = t.tensor
        code = float(np.asarray(c.array, np.float64).reshape(())) / q.scale + q.zero_point
        if not (np.isfinite(code) and code == round(code) and q.qmin <= code <= q.qmax):
            return None
        fill = b.constant(node_name(node) + "_fill", np.full(1, int(code), q.dtype), q.scale,
                          q.zero_point)  # fmt: skip
        out = b.like(node.output[0], q)
        b.step("where", node_name(node), [keep(), *((q, fill) if first else (fill, q))], out,
               dtype=q.dtype)  # fmt: skip
        return QValue(out)
    return None
