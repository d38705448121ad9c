"""Per-tensor scales and zero points stored with shape [1] instead of as scalars (older exporters
write them; ONNX's QuantizeLinear / DequantizeLinear take both). The import sweep of 2026-12-03
(ORT's files with every scalar parameter made shape [1]): ``qb.lower`` stopped at the Gather of
an int8 table by run-time ids ("TypeError: only 0-dimensional arrays can be converted to Python
scalars"), and ``qb.fold`` wrote QLinearAdd / QLinearMul with shape-[1] parameters, which ONNX
Runtime refuses to load ("Scale and Zero-point must be a scalar")."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb


def _one_element(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every scalar Q/DQ scale and zero point stored with shape [1]."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    qdq = ("QuantizeLinear", "DequantizeLinear")
    names = {n.input[i] for n in out.graph.node if n.op_type in qdq
             for i in (1, 2) if len(n.input) > i}  # fmt: skip
    for k, init in enumerate(out.graph.initializer):
        if init.name in names and not init.dims:
            value = numpy_helper.to_array(init).reshape(1)
            out.graph.initializer[k].CopyFrom(numpy_helper.from_array(value, init.name))
    return out


def _model(qdq_graph) -> onnx.ModelProto:
    """int8 activations; rows of an int8 table gathered by run-time ids, added to ``x`` (a
    QLinearAdd once folded), then a per-tensor weighted MatMul (QLinearMatMul)."""
    g = qdq_graph((2, 8, 16), scale=0.05, zero=0, dtype=np.int8)
    g.inputs.append(helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 8]))
    emb = g.node("Gather", [g.weight((5, 16), scale=0.01, per_channel=False, low=-63, high=64),
                            "ids"])  # fmt: skip
    emb = g.quant(emb, 0.01, 0, np.int8)
    y = g.quant(g.node("Add", [g.x, emb]), 0.06, 0, np.int8)
    w = g.weight((16, 4), scale=0.02, per_channel=False, low=-63, high=64)
    return g.model(g.quant(g.node("MatMul", [y, w]), 0.1, 0, np.int8))


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 8, 16)).astype(np.float32)
    return {"x": x, "ids": rng.integers(0, 5, (2, 8)).astype(np.int64)}


def _ort(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def test_one_element_parameters_lower_to_the_same_program(qdq_graph):
    """The same grids, stored with another shape: the program's codes are identical (0 LSB)."""
    model = _model(qdq_graph)
    moved = _one_element(model)
    assert any(list(i.dims) == [1] for i in moved.graph.initializer)
    (expected,) = qb.lower(model).run(_feeds()).values()
    (got,) = qb.lower(moved).run(_feeds()).values()
    np.testing.assert_array_equal(got, expected)


def test_one_element_parameters_fold_to_a_model_ort_loads(qdq_graph):
    """The folded file holds scalar parameters where its QOperator ops read them, loads in ONNX
    Runtime and computes what the fold of the scalar file computes: the same integer kernels on
    the same values, 0 LSB."""
    model = _model(qdq_graph)
    folded, folded_moved = qb.fold(model), qb.fold(_one_element(model))
    ops = {n.op_type for n in folded_moved.graph.node}
    assert {"QLinearAdd", "QLinearMatMul"} <= ops
    inits = {i.name: i for i in folded_moved.graph.initializer}
    for n in folded_moved.graph.node:
        if n.op_type == "QLinearAdd":
            assert all(not inits[i].dims for i in n.input if i in inits)
    np.testing.assert_array_equal(_ort(folded_moved, _feeds()), _ort(folded, _feeds()))
