"""``exporter._optimize.first_output_filtered``: torch's ONNX optimizer gives the same model with
its multi-output rules filtered by their first output node, and the filter is undone after."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

onnxscript = pytest.importorskip("onnxscript")
from onnxscript import rewriter  # noqa: E402
from onnxscript.optimizer import optimize_ir  # noqa: E402

from quantbridge.onnx.exporter._optimize import first_output_filtered  # noqa: E402


def _model(chains: int = 30) -> onnx.ModelProto:
    """X (1x4x8x8) -> two Slices halving its last axis (SlicesSplit's case) -> Relu each ->
    Add, then ``chains`` Relu/Add nodes, so that the rule is tried at many other nodes."""
    consts = {
        name: numpy_helper.from_array(np.array(v, dtype=np.int64), name)
        for name, v in {"s0": [0], "e0": [4], "s1": [4], "e1": [8], "ax": [3]}.items()
    }
    nodes = [
        # the upper half first: the matcher pairs a Slice with the first Slice of the graph
        helper.make_node("Slice", ["X", "s1", "e1", "ax"], ["b"]),
        helper.make_node("Slice", ["X", "s0", "e0", "ax"], ["a"]),
        helper.make_node("Relu", ["a"], ["ra"]),
        helper.make_node("Relu", ["b"], ["rb"]),
        helper.make_node("Add", ["ra", "rb"], ["y0"]),
    ]
    for i in range(chains):
        nodes.append(helper.make_node("Relu", [f"y{i}"], [f"r{i}"]))
        nodes.append(helper.make_node("Add", [f"r{i}", f"y{i}"], [f"y{i + 1}"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info(f"y{chains}", TensorProto.FLOAT, [1, 4, 8, 4])],
        list(consts.values()),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _optimized(filtered: bool) -> bytes:
    model = ir.serde.deserialize_model(_model())
    with first_output_filtered() if filtered else _nothing():
        optimize_ir(model)
    return ir.serde.serialize_model(model).SerializeToString()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_filtered_optimizer_gives_the_same_model():
    plain, filtered = _optimized(False), _optimized(True)
    assert filtered == plain
    ops = [n.op_type for n in onnx.load_from_string(plain).graph.node]
    assert "Split" in ops and "Slice" not in ops  # the multi-output rule did rewrite


def test_filter_skips_other_nodes_and_is_undone(monkeypatch):
    multi = [
        r for r in rewriter._DEFAULT_REWRITE_RULES if not r._target_pattern.has_single_output_node
    ]
    assert multi, "onnxscript has no multi-output rule: the filter has nothing to do"
    model = ir.serde.deserialize_model(_model())
    relu = next(n for n in model.graph if n.op_type == "Relu")
    walks: list[int] = []
    walk = type(model.graph).__iter__
    monkeypatch.setattr(type(model.graph), "__iter__", lambda g: walks.append(1) or walk(g))
    with first_output_filtered():
        for rule in multi:
            assert "match" in vars(rule._matcher)
            assert not rule._matcher.match(model, model.graph, relu)
    assert walks == []  # no walk over the graph for a node the rules cannot start at
    assert not rule._matcher.match(model, model.graph, relu)
    assert walks  # unfiltered, the matcher walks the graph first
    assert all("match" not in vars(rule._matcher) for rule in multi)
