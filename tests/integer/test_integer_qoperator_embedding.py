"""``qb.lower`` of ONNX Runtime's QOperator embedding read by a ``QLinearMatMul``:
``Gather(int8 table, ids) -> QLinearMatMul`` (``quantize_static(QOperator)`` of a model whose
embedding feeds a Linear, MiniLM-style). The gathered rows are integer codes computed by the
graph; ``QLinearMatMul`` refused them ("an operand is not integer codes"; import sweep of
2026-12-03), while ``QLinearAdd`` (unfolded to QDQ first) already read them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb

VOCAB, T, D, N = 20, 6, 16, 8


def _file() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    # 7-bit weights: ORT's int8 kernels add product pairs in saturating int16 on x86 without
    # VNNI (quantbridge._platform); +-63 keeps them exact there
    inits = [
        numpy_helper.from_array(rng.integers(-127, 128, (VOCAB, D)).astype(np.int8), "table"),
        numpy_helper.from_array(np.float32(0.02), "s_e"),
        numpy_helper.from_array(np.int8(0), "z_e"),
        numpy_helper.from_array(rng.integers(-63, 64, (D, N)).astype(np.int8), "w"),
        numpy_helper.from_array(np.float32(0.01), "s_w"),
        numpy_helper.from_array(np.int8(0), "z_w"),
        numpy_helper.from_array(np.float32(0.5), "s_y"),
        numpy_helper.from_array(np.int8(3), "z_y"),
    ]
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"], name="embed"),
        helper.make_node(
            "QLinearMatMul",
            ["rows", "s_e", "z_e", "w", "s_w", "z_w", "s_y", "z_y"],
            ["yq"],
            name="fc",
        ),  # fmt: skip
        helper.make_node("DequantizeLinear", ["yq", "s_y", "z_y"], ["y"], name="out"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, T])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, T, N])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_gathered_rows_read_by_qlinearmatmul_lower():
    """Program vs ONNX Runtime's QLinearMatMul on the same codes: ORT requantizes the int32 sum
    with a float multiplier, the program with a fixed-point one: a .5 tie may differ by one
    step, at most 1 LSB."""
    model = _file()
    ids = np.random.default_rng(1).integers(0, VOCAB, (2, T)).astype(np.int64)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = sess.run(None, {"ids": ids})[0]
    (got,) = qb.lower(model).run({"ids": ids}).values()
    assert np.unique(expected).size > 4  # not a saturated output
    assert np.abs(np.asarray(got, np.float64) - expected).max() <= 0.5 * 1.001
