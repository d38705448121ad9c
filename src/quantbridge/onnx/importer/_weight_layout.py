"""Layout ops between an integer weight's DequantizeLinear and its layer, moved onto the codes.

Graph tools and hand edits write a weight as ``DQ(W^T) -> Transpose -> MatMul`` or
``DQ(W[None]) -> Reshape -> MatMul``. The import records a weight where a DequantizeLinear of an
integer constant feeds the layer (``_quantized`` Case 2); behind a layout op the folded float
constant lost that record, and the layer imported with a float weight, without a word (its
re-export wrote the weight as float32; import sweep of 2026-12-03, every MatMul of a
MiniLM-style file). ``sink_weight_layout`` applies the op to the integer codes instead, exactly
(it moves codes; per-axis parameters follow their axis):

* Case 1: ``Transpose(perm)``: codes transposed, ``axis`` -> ``perm.index(axis)``;
* Case 2: ``Reshape`` to a constant shape, ``Squeeze`` / ``Unsqueeze`` (axes attribute or
  constant input) that only insert or remove dimensions of size 1: the codes reshaped, ``axis``
  -> the position of the same non-1 dimension.

Not applied: a DQ read by anything else as well, block-quantized (``block_size``) DQs, a
per-axis DQ over a dimension of size 1, and non-constant shapes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

_RESHAPES = ("Reshape", "Squeeze", "Unsqueeze")


def _attr(node: onnx.NodeProto, name: str, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _moved(node: onnx.NodeProto, codes: np.ndarray, consts: dict) -> np.ndarray | None:
    """``node`` applied to ``codes``, or None when it is not a layout op on constants."""
    if node.op_type == "Transpose":
        return np.transpose(codes, _attr(node, "perm") or list(range(codes.ndim))[::-1])
    if node.op_type not in _RESHAPES:
        return None
    second = node.input[1] if len(node.input) > 1 and node.input[1] else None
    if second is not None and second not in consts:
        return None
    if node.op_type == "Reshape":
        if second is None or _attr(node, "allowzero", 0):
            return None
        target = [int(d) for d in consts[second]]
        target = [codes.shape[i] if d == 0 else d for i, d in enumerate(target)]
        return codes.reshape(target)
    axes = [int(a) for a in (consts[second] if second is not None else _attr(node, "axes", []))]
    if node.op_type == "Squeeze":
        return np.squeeze(codes, axis=tuple(axes)) if axes else np.squeeze(codes)
    return np.expand_dims(codes, tuple(a % (codes.ndim + len(axes)) for a in axes))


def _new_axis(node: onnx.NodeProto, before: tuple, after: tuple, axis: int) -> int | None:
    if node.op_type == "Transpose":
        perm = _attr(node, "perm") or list(range(len(before)))[::-1]
        return list(perm).index(axis)
    if before[axis] == 1:
        return None
    ordinal = sum(1 for d in before[:axis] if d != 1)
    kept = [i for i, d in enumerate(after) if d != 1]
    if [before[i] for i in range(len(before)) if before[i] != 1] != [after[i] for i in kept]:
        return None  # not only size-1 dimensions inserted / removed
    return kept[ordinal]


def sink_weight_layout(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto``, or a copy whose layout ops on DQ'd integer weights act on the codes."""
    graph = proto.graph
    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}
    rewrites = []  # (dq, mover, new codes, new axis)
    for dq in graph.node:
        if dq.op_type != "DequantizeLinear" or dq.input[0] not in consts or _attr(dq, "block_size"):
            continue
        users = readers.get(dq.output[0], [])
        codes = consts[dq.input[0]]
        if len(users) != 1 or dq.output[0] in outputs or codes.dtype.kind not in "iu":
            continue
        mover = users[0]
        if mover.input[0] != dq.output[0] or (moved := _moved(mover, codes, consts)) is None:
            continue
        per_axis = consts.get(dq.input[1], np.zeros(1)).size > 1
        axis = _attr(dq, "axis", 1) % codes.ndim if per_axis else None
        new_axis = None if axis is None else _new_axis(mover, codes.shape, moved.shape, axis)
        if per_axis and new_axis is None:
            continue
        rewrites.append((dq, mover, moved, new_axis))
    if not rewrites:
        return proto
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    gone = {m.output[0] for _, m, _, _ in rewrites}
    by_output = {dq.output[0]: (m, moved, axis) for dq, m, moved, axis in rewrites}
    nodes = []
    for n in out.graph.node:
        if n.output and n.output[0] in gone:
            continue  # the layout op: its output is now the DQ's
        if n.op_type == "DequantizeLinear" and n.output[0] in by_output:
            mover, moved, axis = by_output[n.output[0]]
            name = f"{n.input[0]}_{mover.op_type.lower()}"
            while name in consts:
                name += "_qb"
            consts[name] = moved
            codes = numpy_helper.from_array(moved, name)
            out.graph.initializer.append(codes)
            n.input[0], n.output[0] = codes.name, mover.output[0]
            if axis is not None:
                for a in [a for a in n.attribute if a.name == "axis"]:
                    n.attribute.remove(a)
                n.attribute.append(helper.make_attribute("axis", axis))
        nodes.append(n)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    read = {i for n in nodes for i in n.input} | outputs
    kept = [i for i in out.graph.initializer if i.name in read]  # the codes before the move
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    return out
