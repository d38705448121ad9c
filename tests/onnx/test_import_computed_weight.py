"""``import_onnx`` of a weight computed from constants and then quantized: torch's weight norm
(``nn.utils.parametrizations.weight_norm``, the positional conv of HuBERT / wav2vec 2.0) exports
``g * v / ReduceL2(v)`` -> QuantizeLinear (per channel) -> DequantizeLinear -> Conv. Regression
sweep, 2026-12-02: the float import folded the constant branch and the quantizer (``Site``) with
it, so the conv ran on the float weight (HuBERT: import vs the QuantModel it came from 42 dB,
every weight of the conv off its grid). Reference: ONNX Runtime on the file."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb


def _file():
    rng = np.random.default_rng(0)
    v = rng.normal(0, 1, (4, 3, 3)).astype(np.float32)  # Conv1d weight (out, in, k)
    g = rng.uniform(0.5, 2, (4, 1, 1)).astype(np.float32)
    w_scale = (np.abs(g).reshape(-1) / 127).astype(np.float32)  # |w| <= g per output channel
    inits = [numpy_helper.from_array(a, n) for a, n in [
        (v, "v"), (g, "g"), (np.array([1, 2], np.int64), "axes"), (w_scale, "ws"),
        (np.zeros(4, np.int8), "wz"), (np.float32(0.03), "xs"), (np.uint8(128), "xz"),
        (np.float32(0.05), "ys"), (np.uint8(128), "yz")]]  # fmt: skip
    nodes = [
        helper.make_node("ReduceL2", ["v", "axes"], ["norm"], keepdims=1),
        helper.make_node("Div", ["g", "norm"], ["gain"]),
        helper.make_node("Mul", ["v", "gain"], ["w"]),
        helper.make_node("QuantizeLinear", ["w", "ws", "wz"], ["wq"], axis=0),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("Conv", ["xd", "wd"], ["acc"], pads=[1, 1]),
        helper.make_node("QuantizeLinear", ["acc", "ys", "yz"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "weight_norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 10])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def test_computed_weight_keeps_its_quantizer():
    """The import runs the same int8 weight codes as ONNX Runtime: the same output codes (with
    the float weight it used before: 8 of the 80 codes 1 LSB off)."""
    model = _file()
    x = np.random.default_rng(1).normal(0, 1, (2, 3, 10)).astype(np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ref = sess.run(None, {"x": x})[0]
    qm = qb.import_onnx(model)
    with torch.no_grad():
        got = qm(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
