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
