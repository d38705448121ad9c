"""Quantization inside control-flow bodies (the subgraphs of If / Loop / Scan: ONNX Runtime's
``EnableSubgraph``, hand-made graphs). quantbridge reads a model's main graph only; this finds
the control-flow nodes whose bodies quantize, so that fold, lower and compare name them instead of
calling such a model float."""

from __future__ import annotations

import onnx

# ops whose presence makes a graph quantized (Q/DQ pairs, integer operators)
_QUANTIZATION_OPS = frozenset({
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
    "ConvInteger", "MatMulInteger",
})  # fmt: skip


def _bodies(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    graphs = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            graphs.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            graphs.extend(a.graphs)
    return graphs


def _quantizes(graph: onnx.GraphProto) -> bool:
    return any(
        n.op_type in _QUANTIZATION_OPS or n.op_type.startswith("QLinear")
        or any(_quantizes(g) for g in _bodies(n))
        for n in graph.node
    )  # fmt: skip


def quantized_bodies(model: onnx.ModelProto | onnx.GraphProto) -> list[str]:
    """``"If 'name'"`` for each main-graph node with a body that quantizes."""
    graph = model.graph if isinstance(model, onnx.ModelProto) else model
    return [f"{n.op_type} {n.name or n.output[0]!r}" for n in graph.node
            if any(_quantizes(g) for g in _bodies(n))]  # fmt: skip


def refusal(model: onnx.ModelProto | onnx.GraphProto, action: str) -> str | None:
    """The message for a model whose only quantization is inside control-flow bodies, or None."""
    nodes = quantized_bodies(model)
    if not nodes:
        return None
    return (
        f"the model quantizes only inside control-flow subgraphs ({', '.join(nodes[:3])}"
        f"{', ...' if len(nodes) > 3 else ''}): quantbridge reads the main graph, not If / Loop "
        f"/ Scan bodies, so it cannot {action} it. Export the model without the control flow "
        "(each branch as its own model, or the loop unrolled), quantize that, and "
        f"{action} it"
    )
