"""Padding on the integer codes: ``DQ(s, z) -> Pad -> Q(s, z)`` becomes ``Pad(codes)``.

Placement gives a zero (or reflect / edge / wrap) padding the grid of its input (``torch._ops``
``PAD_OPS``: it commutes with quantization), so the export writes ``DQ -> Pad -> Q`` with the
same parameters on both sides. ONNX Runtime (1.32) does not drop Q/DQ around a Pad: the tensor is
dequantized, padded in float and quantized again before the next QLinearConv. The rewrite pads
the codes instead, with the zero point as the constant: exact, since for a per-tensor grid

* ``Q(DQ(q)) == q`` (``round(q - z) + z = q`` inside the type's range), so copied elements keep
  their codes;
* a padded 0 quantizes to ``clip(round(0 / s) + z) == z``, the code the integer Pad writes.

Applied where the Pad's mode is reflect / edge / wrap or its constant is 0, the Pad is the only
reader of the DequantizeLinear output it pads, the QuantizeLinear is the only reader of the
Pad's output, and both have equal constant per-tensor parameters. The DequantizeLinear goes when
the Pad was its only reader.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _attribute(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _params(consts: dict, node: onnx.NodeProto) -> tuple | None:
    """(scale, zero point) arrays of a per-tensor Q/DQ with constant parameters, else None."""
    if len(node.input) < 3 or not node.input[2] or _attribute(node, "block_size", 0):
        return None
    scale, zero_point = consts.get(node.input[1]), consts.get(node.input[2])
    if scale is None or zero_point is None or scale.size != 1 or zero_point.size != 1:
        return None
    return scale, zero_point


def _same(a: tuple, b: tuple) -> bool:
    return (
        a[1].dtype == b[1].dtype
        and np.array_equal(a[0].ravel(), b[0].ravel())
        and np.array_equal(a[1].ravel(), b[1].ravel())
    )


def pad_on_codes(model: onnx.ModelProto) -> int:
    """Rewrite ``model``'s main graph in place; returns how many Pads now pad codes."""
    graph = model.graph
    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    producer = {t: n for n in graph.node for t in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)
    outputs = {o.name for o in graph.output}
    drop, dropped_constants, done = [], set(), 0
    for pad in list(graph.node):
        if pad.op_type != "Pad" or pad.output[0] in outputs:
            continue
        dq, users = producer.get(pad.input[0]), readers.get(pad.output[0], [])
        if dq is None or dq.op_type != "DequantizeLinear" or len(users) != 1:
            continue
        q = users[0]
        dq_params = _params(consts, dq)
        if q.op_type != "QuantizeLinear" or q.input[0] != pad.output[0] or dq_params is None:
            continue
        q_params = _params(consts, q)
        if q_params is None or not _same(dq_params, q_params):
            continue
        mode = _attribute(pad, "mode", b"constant")
        constant = pad.input[2] if len(pad.input) > 2 and pad.input[2] else ""
        if mode in (b"constant", "constant") and constant:
            value = consts.get(constant)
            if value is None or np.any(value != 0):
                continue
        if constant and len(readers.get(constant, [])) == 1:
            dropped_constants.add(constant)
        inputs = [dq.input[0], pad.input[1]]
        if mode in (b"constant", "constant"):
            name = f"{q.output[0]}_pad_zero_point"
            graph.initializer.append(numpy_helper.from_array(dq_params[1].reshape(()), name))
            inputs.append(name)
        else:
            inputs.append("")
        inputs += list(pad.input[3:4])  # axes (opset 18)
        while inputs and not inputs[-1]:
            inputs.pop()
        pad.input[:] = inputs
        pad.output[0] = q.output[0]
        drop.append(q)
        if len(readers.get(dq.output[0], [])) == 1 and dq.output[0] not in outputs:
            drop.append(dq)
        done += 1
    for node in drop:
        graph.node.remove(node)
    for init in [i for i in graph.initializer if i.name in dropped_constants]:
        graph.initializer.remove(init)
    return done
