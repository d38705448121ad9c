"""float16 quantized graphs read as float32 (NVIDIA ModelOpt's default ONNX PTQ mode and alike).

ModelOpt writes whole-fp16 graphs: ``Cast(to=FLOAT16)`` after each float32 input, float16
weights, biases and Q/DQ scales, float16 compute, ``Cast(to=FLOAT)`` before each output.
``widen_float16`` rewrites such a graph to float32 before the quantized import:

* float16 initializers, ``Constant`` values and ``ConstantOfShape`` fill values become float32
  (every float16 value is exactly a float32 value: the scales, zero points and hence the int8
  codes' grids are kept exactly);
* ``Cast(to=FLOAT16)`` becomes ``Cast(to=FLOAT)`` (the identity on a float32 tensor, the same
  conversion on an integer one); value_info, graph inputs and outputs typed float16 become float32.

The imported model then computes in float32 where the file computes in float16, so its outputs
differ from ONNX Runtime's on the file by float16 rounding (about 2^-11 relative per op, more
where an activation's rounding moves a code across a quantizer step): ``Float16GraphWarning``
says so once, naming the file's input and output Casts. bfloat16 graphs are not widened (their
scales are refused by ``_qparams.read_qparams``).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import numpy_helper

from ...torch._capture import user_stacklevel

FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


class Float16GraphWarning(UserWarning):
    """The imported file computes in float16; the imported model computes in float32."""


def is_float16(proto: onnx.ModelProto) -> bool:
    """Whether the graph holds float16 constants, Casts to float16 or float16-typed tensors."""
    return any(_float16_parts(g) for g in _graphs(proto.graph))


def widen_float16(proto: onnx.ModelProto, *, float_casts: str = "keep") -> onnx.ModelProto:
    """A float32 copy of a float16 graph (``proto`` itself when it has nothing float16), with a
    ``Float16GraphWarning`` naming the file's input / output Casts.

    ``float_casts="identity"``: the main graph's Casts from a float type to a float type (the
    input and output Casts, float32 to float32 once widened) become ``Identity`` nodes of the same
    name, for the passes that have no Cast (``onnx.fold``, ``integer.lower``). A Cast whose input
    type shape inference cannot tell is kept."""
    if float_casts not in ("keep", "identity"):
        raise ValueError(f"float_casts must be 'keep' or 'identity', got {float_casts!r}")
    if not is_float16(proto):
        return proto
    inputs = {i.name for i in proto.graph.input}
    outputs = {o.name for o in proto.graph.output}
    in_casts, out_casts = [], []
    for node in proto.graph.node:
        if node.op_type != "Cast":
            continue
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        label = node.name or node.output[0]
        if to == FLOAT16 and node.input[0] in inputs:
            in_casts.append(f"{label} ({node.input[0]} -> float16)")
        elif to == FLOAT and node.output[0] in outputs:
            out_casts.append(f"{label} (float16 -> {node.output[0]})")
    typed = [
        v.name
        for v in (*proto.graph.input, *proto.graph.output)
        if v.type.tensor_type.elem_type == FLOAT16
    ]
    wide = onnx.ModelProto()
    wide.CopyFrom(proto)
    for graph in _graphs(wide.graph):
        _widen_graph(graph)
    if float_casts == "identity":
        _float_casts_as_identity(proto, wide.graph)
    warnings.warn(
        "the ONNX file computes in float16 (float16 weights, scales and activations; input Casts: "
        f"{', '.join(in_casts) or 'none'}; output Casts: {', '.join(out_casts) or 'none'}"
        + (
            f"; float16 graph inputs/outputs {typed} are float32 in the imported model"
            if typed
            else ""
        )
        + "); quantbridge reads it in float32 (scales, zero points and integer codes kept "
        "exactly, the Casts to float16 made float32), so its outputs differ from the file's by "
        "float16 rounding (~1e-3 relative)",
        Float16GraphWarning,
        stacklevel=user_stacklevel(),
    )
    return wide


def _graphs(graph: onnx.GraphProto):
    """``graph`` and its subgraphs (If / Loop / Scan bodies)."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


def _float16_parts(graph: onnx.GraphProto) -> bool:
    if any(t.data_type == FLOAT16 for t in graph.initializer):
        return True
    for v in (*graph.input, *graph.output, *graph.value_info):
        if v.type.tensor_type.elem_type == FLOAT16:
            return True
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == FLOAT16:
                return True
            if node.op_type == "Cast" and attr.name == "to" and attr.i == FLOAT16:
                return True
    return False


def _float_casts_as_identity(proto: onnx.ModelProto, wide: onnx.GraphProto) -> None:
    """Cast nodes of ``wide`` (the widened main graph of ``proto``) from a float type to a float
    type in ``proto``, replaced by ``Identity``."""
    try:
        typed = onnx.shape_inference.infer_shapes(proto, strict_mode=False).graph
    except Exception:  # noqa: BLE001 - unknown ops or broken shapes: the declared types only
        typed = proto.graph
    dtype = {t.name: t.data_type for t in typed.initializer}
    for v in (*typed.input, *typed.output, *typed.value_info):
        dtype[v.name] = v.type.tensor_type.elem_type
    floats = (FLOAT, FLOAT16)
    for i, node in enumerate(wide.node):
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if node.op_type == "Cast" and to in floats and dtype.get(node.input[0]) in floats:
            wide.node[i].CopyFrom(
                onnx.helper.make_node("Identity", [node.input[0]], [node.output[0]], node.name)
            )


def _widened(tensor: onnx.TensorProto) -> onnx.TensorProto:
    wide = numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)
    if tensor.doc_string:
        wide.doc_string = tensor.doc_string
    return wide


def _widen_graph(graph: onnx.GraphProto) -> None:
    for i, t in enumerate(graph.initializer):
        if t.data_type == FLOAT16:
            graph.initializer[i].CopyFrom(_widened(t))
    for v in (*graph.input, *graph.output, *graph.value_info):
        if v.type.tensor_type.elem_type == FLOAT16:
            v.type.tensor_type.elem_type = FLOAT
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == FLOAT16:
                attr.t.CopyFrom(_widened(attr.t))
            elif attr.name == "to" and node.op_type == "Cast" and attr.i == FLOAT16:
                attr.i = FLOAT
