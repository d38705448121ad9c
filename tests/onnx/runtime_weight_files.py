"""Test data: quantized ONNX files whose weights are stored float and quantized at run time
(``W float -> QuantizeLinear(scale, zero point, axis) -> DequantizeLinear``), the form NVIDIA
ModelOpt's ONNX PTQ writes (fp32 and fp16 modes, read from its output on a Conv+BN+ReLU,
depthwise, residual, Gemm model: per-channel int8 weight scales on axis 0, zero points 0,
signed int8 activations, zero point 0, also after a ReLU). Built with ``onnx.helper``: ModelOpt
is not a test dependency.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

C, H, K = 3, 6, 4  # input channels, spatial size, conv channels
CLASSES = 5


def weight_nodes(name, w, per_channel, qtype, scale_dtype=np.float32, axis=0):
    """``name`` (float initializer) -> Q -> DQ -> ``name + "_dq"``: nodes and initializers.
    int8: symmetric (zero point 0); uint8: zero point 128 (per tensor) or per-channel 120 + k."""
    w = np.asarray(w, np.float32)
    if per_channel:
        amax = np.abs(w).reshape(w.shape[axis], -1).max(1) if axis == 0 else np.abs(w).max(0)
    else:
        amax = np.abs(w).max()
    scale = (amax / 127.0).astype(scale_dtype)
    if qtype == np.int8:
        zp = np.zeros(np.shape(scale), np.int8)
    else:
        zp = (120 + np.arange(np.size(scale)) % 16).astype(np.uint8).reshape(np.shape(scale))
        zp = zp if per_channel else np.array(128, np.uint8)
    inits = [
        numpy_helper.from_array(w.astype(scale_dtype), name),
        numpy_helper.from_array(scale, name + "_scale"),
        numpy_helper.from_array(zp, name + "_zp"),
    ]
    args = [name + "_scale", name + "_zp"]
    kw = {"axis": axis} if per_channel else {}
    nodes = [
        helper.make_node("QuantizeLinear", [name, *args], [name + "_q"], name + "_Q", **kw),
        helper.make_node("DequantizeLinear", [name + "_q", *args], [name + "_dq"], **kw),
    ]
    return nodes, inits


def _act(tensor, scale, name, qtype=np.int8):
    """Q/DQ of an activation: int8 zero point 0 (ModelOpt's activations), or uint8 zero point
    128 (ONNX Runtime has no QLinearConv for int8 inputs and uint8 weights)."""
    inits = [
        numpy_helper.from_array(np.array(scale, np.float32), name + "_s"),
        numpy_helper.from_array(np.array(0 if qtype == np.int8 else 128, qtype), name + "_z"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", [tensor, name + "_s", name + "_z"], [name + "_q"]),
        helper.make_node("DequantizeLinear", [name + "_q", name + "_s", name + "_z"], [name]),
    ]
    return nodes, inits


def cnn_file(qtype=np.int8, per_channel: bool = True, seed: int = 0) -> onnx.ModelProto:
    """x -> Q/DQ -> Conv 3x3 (+bias) -> Relu -> Q/DQ -> depthwise Conv 3x3 -> Relu -> Q/DQ -> Add
    (residual) -> Q/DQ -> Flatten -> Gemm (transB) -> Q/DQ -> y, every weight a float initializer
    quantized at run time (``weight_nodes``). Fully quantized: every form applies (fold, lower)."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def add(part):
        nodes.extend(part[0])
        inits.extend(part[1])

    add(_act("x", 0.03, "xd", qtype))
    add(weight_nodes("w1", rng.normal(0, 0.3, (K, C, 3, 3)), per_channel, qtype))
    add(weight_nodes("w2", rng.normal(0, 0.3, (K, 1, 3, 3)), per_channel, qtype))
    add(weight_nodes("w3", rng.normal(0, 0.1, (CLASSES, K * H * H)), per_channel, qtype))
    inits += [
        numpy_helper.from_array(rng.normal(0, 0.1, K).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.normal(0, 0.1, K).astype(np.float32), "b2"),
        numpy_helper.from_array(rng.normal(0, 0.1, CLASSES).astype(np.float32), "b3"),
    ]
    nodes += [
        helper.make_node("Conv", ["xd", "w1_dq", "b1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
    ]
    add(_act("r1", 0.04, "r1d", qtype))
    nodes += [
        helper.make_node("Conv", ["r1d", "w2_dq", "b2"], ["c2"], "dw", pads=[1, 1, 1, 1], group=K),
        helper.make_node("Relu", ["c2"], ["r2"], "relu2"),
    ]
    add(_act("r2", 0.04, "r2d", qtype))
    nodes.append(helper.make_node("Add", ["r2d", "r1d"], ["s"], "residual"))
    add(_act("s", 0.06, "sd", qtype))
    nodes.append(helper.make_node("Flatten", ["sd"], ["f"], "flatten", axis=1))
    nodes.append(helper.make_node("Gemm", ["f", "w3_dq", "b3"], ["g"], "fc", transB=1))
    add(_act("g", 0.05, "y", qtype))
    graph = helper.make_graph(
        nodes,
        "runtime_weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, C, H, H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, CLASSES])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model
