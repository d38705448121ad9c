"""Opset down-conversion of our exported graphs (the torch exporter emits opset 18 or newer).

``onnx.version_converter`` cannot down-convert these graphs ("No Adapter From Version $14 for
Relu"; the torch exporter's own attempt fails on ReduceMean), so we convert the few op forms we
emit that changed between opset 13 and 18, as data:

* Case 1 - ``Reduce{Mean,Max,Min,Prod,L1,L2,LogSum,LogSumExp,SumSquare}``: opset 18 takes ``axes``
  as an input; before 18 it is an attribute. A constant ``axes`` input becomes the attribute.
* Case 2 - ``Split`` with opset 18's ``num_outputs``: refused with the fix (sizes would depend on
  the input shape).

* Case 3 - attributes that newer opsets added with a neutral default (``Reshape.allowzero=0``
  and ``LSTM`` / ``GRU`` / ``RNN`` ``layout=0`` (time-major) since 14; ``Resize.antialias=0`` and
  ``keep_aspect_ratio_policy="stretch"`` since 18, which torch's exporter writes on every
  ``F.interpolate``): dropped when neutral, refused otherwise.
  ``allowzero=1`` is neutral too when the constant target shape holds no 0 (the only case where
  the two modes differ).

* Case 4 - ``Shape`` with opset 15's ``start`` / ``end`` (the torch exporter's batch size of a
  re-exported opset-14 file, TorchScript BERT): a plain ``Shape`` then a ``Slice`` of it.

Every other op must exist, unchanged, at the target opset; the schema check names the first
that does not (e.g. LayerNormalization needs opset 17) and the fix (a higher opset).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

_AXES_TO_ATTRIBUTE = {
    "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
}  # fmt: skip
# (op, attribute) -> (opset that introduced it, its neutral value)
_NEW_ATTRIBUTES = {
    ("Reshape", "allowzero"): (14, 0),
    ("LSTM", "layout"): (14, 0),
    ("GRU", "layout"): (14, 0),
    ("RNN", "layout"): (14, 0),
    ("Resize", "antialias"): (18, 0),
    ("Resize", "keep_aspect_ratio_policy"): (18, b"stretch"),
}


def downgrade(model: onnx.ModelProto, target: int) -> onnx.ModelProto:
    """A copy of ``model`` (default domain at opset >= 18) re-expressed at ``target`` opset."""
    current = _default_opset(model)
    if target >= current:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    consts = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    for node in out.graph.node:
        if target < 18 and node.op_type in _AXES_TO_ATTRIBUTE and len(node.input) > 1:
            _axes_to_attribute(node, consts)  # Case 1
        elif target < 18 and node.op_type == "Split":
            _split_sizes_to_input(node)  # Case 2
        _drop_new_attributes(node, target, consts)  # Case 3
    if target < 15:
        _slice_shapes(out.graph)  # Case 4
    for imp in out.opset_import:
        if imp.domain in ("", "ai.onnx"):
            imp.version = target
    _check_schemas(out, target)
    return out


def _default_opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _axes_to_attribute(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> None:
    axes_name = node.input[1]
    noop = [a for a in node.attribute if a.name == "noop_with_empty_axes"]
    for a in noop:  # opset 18 only; with constant axes it has no effect
        node.attribute.remove(a)
    if axes_name == "":
        del node.input[1:]
        return
    if axes_name not in consts:
        raise ValueError(
            f"{node.op_type} {node.name!r}: axes {axes_name!r} are computed at run time and cannot "
            "become an attribute below opset 18; export with opset >= 18"
        )
    node.attribute.append(helper.make_attribute("axes", [int(a) for a in consts[axes_name]]))
    del node.input[1:]


def _split_sizes_to_input(node: onnx.NodeProto) -> None:
    attrs = {a.name: a for a in node.attribute}
    if "num_outputs" not in attrs:
        return
    raise ValueError(
        f"Split {node.name!r} uses num_outputs (opset 18); its sizes depend on the input shape. "
        "Export with opset >= 18"
    )


def _slice_shapes(graph: onnx.GraphProto) -> None:
    nodes = []
    for node in graph.node:
        nodes.append(node)
        bounds = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "Shape" or not bounds:
            continue
        del node.attribute[:]
        full, out = node.output[0] + "_full", node.output[0]
        node.output[0] = full
        big = np.iinfo(np.int64).max
        names = []
        for key, value in (("starts", bounds.get("start", 0)), ("ends", bounds.get("end", big))):
            names.append(f"{out}_{key}")
            graph.initializer.append(
                numpy_helper.from_array(np.array([value], np.int64), names[-1])
            )
        nodes.append(helper.make_node("Slice", [full, *names], [out], name=f"{node.name}_slice"))
    del graph.node[:]
    graph.node.extend(nodes)


def _drop_new_attributes(node: onnx.NodeProto, target: int, consts: dict) -> None:
    for attr in list(node.attribute):
        since, neutral = _NEW_ATTRIBUTES.get((node.op_type, attr.name), (0, None))
        if target >= since:
            continue
        value = helper.get_attribute_value(attr)
        if node.op_type == "Reshape" and node.input[1] in consts:
            value = 0 if 0 not in consts[node.input[1]] else value
        if value != neutral:
            raise ValueError(
                f"{node.op_type} {node.name!r}: attribute {attr.name} needs opset >= {since}; "
                f"export with opset={since} or higher"
            )
        node.attribute.remove(attr)


def _check_schemas(model: onnx.ModelProto, target: int) -> None:
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, target, "")
        except onnx.defs.SchemaError:
            schema = None
        if schema is None:
            first = onnx.defs.get_schema(node.op_type).since_version
            raise ValueError(
                f"{node.op_type} {node.name!r} does not exist at opset {target}; it needs opset "
                f">= {first}. Export with opset={max(first, 13)} or higher"
            )
