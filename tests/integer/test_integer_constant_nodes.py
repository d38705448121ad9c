"""``qb.lower`` of a QDQ file whose constants are ``Constant`` nodes, not initializers (toolfiles
sweep, 2026-12-02): torch's exporters and graph tools (onnx-simplifier's inverse, hand edits)
write scales, zero points and integer weights that way. The lowering reads a Constant node as a
constant, but its op check refused the file first ("no integer lowering: Constant")."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

import quantbridge as qb


def _as_constant_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    nodes = [helper.make_node("Constant", [], [i.name], value=i) for i in g.initializer]
    del g.initializer[:]
    rest = list(g.node)
    del g.node[:]
    g.node.extend(nodes + rest)
    return out


def test_constants_as_constant_nodes_lower_to_the_same_program(qdq_graph):
    """Same file, constants moved into Constant nodes: the program's codes are identical (the
    values are the same; only where the file keeps them differs)."""
    g = qdq_graph((2, 3, 8, 8))
    y = g.node("Conv", [g.x, g.weight((4, 3, 3, 3)), g.bias(4, 0.05 * 0.02)], pads=[1, 1, 1, 1])
    y = g.quant(g.node("Relu", [y]), 0.04, 0)
    model = g.model(g.node("GlobalAveragePool", [y]))
    moved = _as_constant_nodes(model)
    assert not moved.graph.initializer and moved.graph.node[0].op_type == "Constant"
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    (expected,) = qb.lower(model).run({"x": x}).values()
    (got,) = qb.lower(moved).run({"x": x}).values()
    np.testing.assert_array_equal(got, expected)


def test_constant_of_shape_token_types_lower(qdq_graph, node_by_node):
    """TorchScript BERT's default token types, ``ConstantOfShape(Shape(ids), 0)`` gathering an
    int8 table (the DequantizeLinear of it, then a QuantizeLinear on its grid): the lowering had
    no ConstantOfShape ("no integer lowering: ConstantOfShape"). Program vs ORT: at most 1 LSB
    of the output grid (one requantized Add: a float32 tie in ORT). Measured: max 1 step."""
    g = qdq_graph((2, 8, 16), scale=0.05, zero=0, dtype=np.int8)
    shape = g.node("Shape", [g.x], end=2)
    types = g.node(
        "ConstantOfShape", [shape], value=onnx.numpy_helper.from_array(np.zeros(1, np.int64))
    )
    emb = g.node("Gather", [g.weight((3, 16), scale=0.01, per_channel=False), types])
    emb = g.quant(emb, 0.01, 0, np.int8)
    y = g.quant(g.node("Add", [g.x, emb]), 0.06, 0, np.int8)
    model = g.model(y)
    x = np.random.default_rng(1).standard_normal((2, 8, 16)).astype(np.float32)
    (got,) = qb.lower(model).run({"x": x}).values()
    (expected,) = node_by_node(model).run(None, {"x": x})
    # one step, plus the float32 rounding of ORT's dequantized output (|y| < 8: < 1e-6)
    assert np.abs(np.asarray(got, np.float64) - expected).max() <= 0.06 + 1e-6
