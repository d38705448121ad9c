"""Shape arithmetic on static shapes, evaluated so that shape inference sees its results.

Exporters compute reshape targets from the input's shape (``x.reshape(B, T, 3, H, C // H)``:
``Shape -> Gather -> Div -> Cast -> Unsqueeze -> Concat -> Reshape``). ONNX's shape inference
propagates such values through a few ops only (``data_prop``: no ``Div``), and a file's own
``value_info`` (ONNX Runtime's quantizer writes symbolic ``unk__4`` dimensions) is kept over what
inference could find. With ``input_shapes`` every ``Shape`` of a static tensor is a constant, so
``fold_shape_arithmetic`` evaluates that arithmetic (``onnx.reference``, one small node at a
time), and ``refined_shapes`` infers again on the folded copy without the file's value_info.
Only the shapes are used: the lowered graph is the file's own.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

# integer / shape arithmetic on small tensors (the ops a reshape target is computed with)
SHAPE_OPS = frozenset({
    "Gather", "Unsqueeze", "Squeeze", "Concat", "Cast", "Div", "Mul", "Add", "Sub", "Slice",
    "Floor", "Ceil", "Sqrt", "Neg", "Abs", "Max", "Min", "Mod", "Range", "Equal", "Where",
    "Identity", "Reshape", "ConstantOfShape", "ReduceProd", "Not", "Less", "Greater",
})  # fmt: skip
_MAX_SIZE = 64  # elements: shape vectors, not tensors of data


def _small(a: np.ndarray) -> bool:
    return a.size <= _MAX_SIZE and a.dtype.kind in "iufb"


def _evaluate(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int) -> list | None:
    from onnx.reference import ReferenceEvaluator

    inputs = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None)
              for n in node.input if n]  # fmt: skip
    outputs = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None)
               for n in node.output if n]  # fmt: skip
    graph = onnx.helper.make_graph([node], "shape", inputs, outputs)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        return ReferenceEvaluator(model).run(None, {n: feeds[n] for n in node.input if n})
    except Exception:  # noqa: BLE001 - a value not found only leaves a shape unknown
        return None


def fold_shape_arithmetic(model: onnx.ModelProto, shapes: dict) -> onnx.ModelProto | None:
    """A copy of ``model`` whose shape arithmetic on static shapes (``Shape`` of a tensor whose
    shape ``shapes`` knows, and ``SHAPE_OPS`` on such values and small constants) is replaced by
    initializers; None when there is none."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 21)
    known = {i.name: numpy_helper.to_array(i) for i in graph.initializer
             if np.prod(i.dims, dtype=np.int64) <= _MAX_SIZE}  # fmt: skip
    folded: dict[str, np.ndarray] = {}
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        values = None
        if node.op_type == "Constant" and node.attribute and node.attribute[0].HasField("t"):
            known[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
            continue
        if node.op_type == "Shape":
            shape = shapes.get(node.input[0])
            if shape is not None and all(isinstance(d, int) and d > 0 for d in shape):
                attrs = {a.name: a.i for a in node.attribute}
                dims = list(shape)[attrs.get("start", 0) : attrs.get("end", len(shape))]
                values = [np.array(dims, np.int64)]
        elif node.op_type in SHAPE_OPS and all(i in known for i in node.input if i):
            if all(_small(known[i]) for i in node.input if i):
                values = _evaluate(node, known, opset)
        if values is None or not all(_small(np.asarray(v)) for v in values):
            continue
        for name, v in zip(node.output, values, strict=False):
            known[name] = folded[name] = np.asarray(v)
    if not folded:
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = [n for n in out.graph.node if not set(n.output) <= set(folded)]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in folded.items())
    return out
