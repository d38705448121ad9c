"""A weight ``DequantizeLinear`` without a zero point (import sweep, 2026-12-02): ONNX reads a
missing zero point as 0 of the input's type, so an int8 weight's DQ is int8. The import took it
as uint8 (the default of a QuantizeLinear without one) and refused the file ("has element type
int8 but its zero point is UINT8"), which ONNX Runtime runs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb

ort = pytest.importorskip("onnxruntime")


def _file(path) -> str:
    """x -> Q(u8) -> DQ -> Conv(DQ(int8 W, per-channel, no zero point), float bias) -> Q -> DQ."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.array(0.02, np.float32), "xs"),
        numpy_helper.from_array(np.array(128, np.uint8), "xz"),
        numpy_helper.from_array(rng.integers(-127, 128, (4, 3, 3, 3)).astype(np.int8), "w"),
        numpy_helper.from_array(rng.uniform(0.001, 0.004, 4).astype(np.float32), "ws"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32) * 0.1, "b"),
        numpy_helper.from_array(np.array(0.05, np.float32), "ys"),
        numpy_helper.from_array(np.array(128, np.uint8), "yz"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="dq"),
        helper.make_node("DequantizeLinear", ["w", "ws"], ["wd"], name="w_dq", axis=0),
        helper.make_node("Conv", ["xd", "wd", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["cq"], name="out_q"),
        helper.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["y"], name="out_dq"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 6, 6])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.save(model, path)
    return str(path)


def test_int8_weight_dq_without_zero_point_imports_as_int8(tmp_path):
    """Torch on the import against ORT node by node, in output steps (0.05): at most 1 step
    (float accumulation order across a rounding boundary of the output Q)."""
    path = _file(tmp_path / "nozp.onnx")
    x = np.random.default_rng(1).standard_normal((2, 3, 6, 6)).astype(np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    qmodel = qb.import_onnx(path)
    with torch.no_grad():
        ours = qmodel(torch.from_numpy(x)).numpy()
    assert np.abs(ours - ref).max() / 0.05 <= 1.0 + 1e-4
    wq = qmodel.quantizers()["conv.weight"]
    assert wq.scheme.signed and wq.scale.shape == (4,)  # int8, per channel, as the file says
