"""1-D windowed ops (ConvTranspose1d, AvgPool1d, MaxPool1d) lowered as their 2-D forms with a
unit height: ``x (N, C, L)`` is unsqueezed to ``(N, C, 1, L)``, the 2-D lowering runs with
kernel ``(1, k)``, strides ``(1, s)``, dilations ``(1, d)``, pads ``(0, p0, 0, p1)`` (and
output padding ``(0, o)``), and its result is squeezed back after its requantization.

The two are the same sums: a window of height 1 over a unit axis with no padding on it reads
exactly the 1-D window, so the integer pipeline, the accumulator bound and every emitter of
the 2-D kernel serve the 1-D op unchanged (the squeeze / unsqueeze are data movement).
"""

from __future__ import annotations

import numpy as np
import onnx

from ._core import Builder, QConst, Value, attrs_of, node_name
from ._movement import moved

UNIT = "::unit_height"  # suffix of the ONNX names of the lifted tensors (never in a real file)

_LEADING = {"kernel_shape": 1, "strides": 1, "dilations": 1, "output_padding": 0}


def _node_2d(node: onnx.NodeProto) -> onnx.NodeProto:
    """``node`` with a leading unit axis in its window attributes, reading and writing the
    lifted tensor names."""
    a = attrs_of(node)
    lifted = {k: [v, *a[k]] for k, v in _LEADING.items() if k in a}
    if "pads" in a:
        lifted["pads"] = [0, a["pads"][0], 0, a["pads"][1]]
    rest = {k: v for k, v in a.items() if k not in lifted}
    inputs = [node.input[0] + UNIT, *node.input[1:]]
    outputs = [node.output[0] + UNIT, *node.output[1:]]
    return onnx.helper.make_node(node.op_type, inputs, outputs, name=node_name(node),
                                 domain=node.domain, **rest, **lifted)  # fmt: skip


def _mover(node: onnx.NodeProto, src: str, dst: str, what: str) -> onnx.NodeProto:
    return onnx.helper.make_node("Identity", [src], [dst], name=f"{node_name(node)}/{what}")


def lifted(b: Builder, node: onnx.NodeProto, ins: list[Value | None], handler) -> list[Value]:
    """``handler`` (a 2-D lowering) applied to the unit-height form of the 1-D ``node``; a
    weight (``ins[1]``, a QConst of rank 3) gains the unit axis too."""
    shape = b.shapes.get(node.input[0])
    node2 = _node_2d(node)
    if shape is not None:
        b.shapes[node2.input[0]] = (*shape[:2], 1, *shape[2:])
    out_shape = b.shapes.get(node.output[0])
    if out_shape is not None:
        b.shapes[node2.output[0]] = (*out_shape[:2], 1, *out_shape[2:])
    x = moved(b, _mover(node, node.input[0], node2.input[0], "unsqueeze"), ins[0], "unsqueeze",
              {"axes": (2,)})  # fmt: skip
    rest = list(ins[1:])
    if rest and isinstance(rest[0], QConst) and np.ndim(rest[0].q) == 3:
        w = rest[0]
        rest[0] = QConst(np.asarray(w.q)[:, :, None], w.scale, w.zero_point, w.axis)
    y = handler(b, node2, [x, *rest])[0]
    return [moved(b, _mover(node, node2.output[0], node.output[0], "squeeze"), y, "squeeze",
                  {"axes": (2,)})]  # fmt: skip
