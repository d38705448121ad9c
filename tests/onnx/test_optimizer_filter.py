"""``exporter._optimize.first_output_filtered``: torch's ONNX optimizer gives the same model with
its rules filtered by their (first) output node, and the filter is undone after."""

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


def _qdq_model(layers: int = 20) -> onnx.ModelProto:
    """A QDQ chain (QuantizeLinear -> DequantizeLinear -> Mul by 1 -> Reshape -> Reshape) that
    single-output rules rewrite (the Mul by one, the Reshape pair) among Q/DQ nodes they skip."""
    inits = [
        numpy_helper.from_array(np.array(0.1, dtype=np.float32), "scale"),
        numpy_helper.from_array(np.array(0, dtype=np.int8), "zp"),
        numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"),
        numpy_helper.from_array(np.array([-1, 8], dtype=np.int64), "flat"),
        numpy_helper.from_array(np.array([1, 4, 8], dtype=np.int64), "back"),
    ]
    nodes = []
    for i in range(layers):
        nodes += [
            helper.make_node("QuantizeLinear", [f"x{i}", "scale", "zp"], [f"q{i}"]),
            helper.make_node("DequantizeLinear", [f"q{i}", "scale", "zp"], [f"d{i}"]),
            helper.make_node("Mul", [f"d{i}", "one"], [f"m{i}"]),
            helper.make_node("Reshape", [f"m{i}", "flat"], [f"f{i}"]),
            helper.make_node("Reshape", [f"f{i}", "back"], [f"x{i + 1}"]),
        ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x0", TensorProto.FLOAT, [1, 4, 8])],
        [helper.make_tensor_value_info(f"x{layers}", TensorProto.FLOAT, [1, 4, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_single_output_rules_are_filtered_and_give_the_same_model(monkeypatch):
    results = []
    for filtered in (False, True):
        model = ir.serde.deserialize_model(_qdq_model())
        with first_output_filtered() if filtered else _nothing():
            optimize_ir(model)
        results.append(ir.serde.serialize_model(model).SerializeToString())
    assert results[1] == results[0]
    ops = [n.op_type for n in onnx.load_from_string(results[0]).graph.node]
    assert "Mul" not in ops and ops.count("Reshape") < 40  # single-output rules did rewrite

    from onnxscript.rewriter import _basics, _matcher

    model = ir.serde.deserialize_model(_qdq_model(1))
    dq = next(n for n in model.graph if n.op_type == "DequantizeLinear")
    single = [
        r
        for r in rewriter._DEFAULT_REWRITE_RULES
        if r._target_pattern.has_single_output_node
        and type(r._matcher) is _matcher.SimplePatternMatcher
        and not r._target_pattern.output_node.matches(dq, _basics.MatchResult())
    ]
    assert single, "no single-output rule refuses a DequantizeLinear: nothing to filter"
    set_ups: list[int] = []
    init = _matcher.SimplePatternMatcher._init_match
    monkeypatch.setattr(
        _matcher.SimplePatternMatcher, "_init_match", lambda m, v: set_ups.append(1) or init(m, v)
    )
    with first_output_filtered():
        for rule in single:
            assert not rule._matcher.match(model, model.graph, dq)
    assert set_ups == []  # refused before the matcher's set-up
    assert all("match" not in vars(rule._matcher) for rule in single)
