"""Integer weights behind a layout op: ``DQ(W^T) -> Transpose -> MatMul`` and
``DQ(W[None]) -> Reshape -> MatMul`` (graph tools and hand edits write them). The import
recorded no weight there: each such layer came in with a float weight, without a warning, and its
re-export wrote the weight as float32 (import sweep of 2026-12-03: every MatMul of a
MiniLM-style file; ``float_layers()`` named 8). ``importer._weight_layout`` moves the op onto the
codes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb

K, N = 16, 6


def _file(via: str) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    codes = rng.integers(-63, 64, (K, N)).astype(np.int8)
    scales = rng.uniform(0.01, 0.02, N).astype(np.float32)
    if via == "Transpose":  # stored W^T (N, K), per-axis along its axis 0
        stored, axis = codes.T.copy(), 0
        layout = helper.make_node("Transpose", ["w_dq"], ["w"], name="w_layout", perm=[1, 0])
        extra = []
    else:  # stored W[None] (1, K, N), per-axis along axis 2
        stored, axis = codes[None], 2
        layout = helper.make_node("Reshape", ["w_dq", "w_shape"], ["w"], name="w_layout")
        extra = [numpy_helper.from_array(np.array([K, N], np.int64), "w_shape")]
    inits = [
        numpy_helper.from_array(stored, "w_q"),
        numpy_helper.from_array(scales, "w_s"),
        numpy_helper.from_array(np.zeros(N, np.int8), "w_z"),
        numpy_helper.from_array(np.float32(0.05), "s"),
        numpy_helper.from_array(np.uint8(128), "z"),
        numpy_helper.from_array(np.float32(0.1), "s_y"),
        *extra,
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q_x"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq_x"),
        helper.make_node(
            "DequantizeLinear", ["w_q", "w_s", "w_z"], ["w_dq"], name="dq_w", axis=axis
        ),  # fmt: skip
        layout,
        helper.make_node("MatMul", ["xd", "w"], ["m"], name="fc"),
        helper.make_node("QuantizeLinear", ["m", "s_y", "z"], ["mq"], name="q_y"),
        helper.make_node("DequantizeLinear", ["mq", "s_y", "z"], ["y"], name="dq_y"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, N])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("via", ["Transpose", "Reshape"])
def test_weight_behind_a_layout_op_imports_quantized(tmp_path, via):
    model = _file(via)
    qmodel = qb.import_onnx(model)
    assert qmodel.float_layers() == {}
    x = np.random.default_rng(1).standard_normal((3, K)).astype(np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    expected = sess.run(None, {"x": x})[0]
    with torch.no_grad():
        got = qmodel(torch.from_numpy(x)).numpy()
    # the same dequantized values in float32, summed in another order: a .5 tie may round to
    # the neighbouring code, at most 1 LSB (0.1)
    assert np.abs(got - expected).max() <= 0.1 * 1.001
    path = tmp_path / "again.onnx"
    again = qb.export(qmodel, path, example_inputs=torch.from_numpy(x))
    inits = {i.name: i for i in again.graph.initializer}
    producer = {o: n for n in again.graph.node for o in n.output}
    (matmul,) = [n for n in again.graph.node if n.op_type in ("MatMul", "Gemm")]
    dq = producer.get(matmul.input[1])
    while dq is not None and dq.op_type != "DequantizeLinear":  # through the export's layout
        dq = producer.get(dq.input[0])
    assert dq is not None and inits[dq.input[0]].data_type == TensorProto.INT8
    codes = numpy_helper.to_array(inits[dq.input[0]])
    expected_codes = numpy_helper.to_array(model.graph.initializer[0]).reshape(-1)
    assert sorted(codes.reshape(-1).tolist()) == sorted(expected_codes.tolist())
