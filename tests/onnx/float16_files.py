"""Test data: small quantized ONNX files in NVIDIA ModelOpt's default (whole float16) form, built by
hand with ``onnx.helper`` (ModelOpt is not a test dependency).

ModelOpt's default mode writes ``Cast(to=FLOAT16)`` after each float32 input, float16 Q/DQ scales,
weights and biases, float16 compute, ``Cast(to=FLOAT)`` before each output. ``conv_file`` is that
pattern around one fully quantized conv (int8 weight codes, a float bias as ModelOpt leaves it),
so that every form quantbridge reads (import, fold, lower) applies; ``dtype=np.float32`` stores
the same values in float32 with no Casts: the file the float16 one must behave like.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

C, K, H = 3, 4, 6
X_SCALE, Y_SCALE = 0.03125, 0.0478  # Y_SCALE is not exact in float16: rounded where stored


def conv_file(dtype=np.float16, bias: bool = True) -> onnx.ModelProto:
    """x -> [Cast] -> Q/DQ (int8) -> Conv 3x3 (int8 weight codes DQ'd per channel, a float bias
    unless ``bias=False``) -> Relu -> Q/DQ (int8, zero point -128: the Relu folds) -> [Cast] -> y; every float constant
    float16-exact. (A float bias keeps the conv out of ``fold``: QLinearConv takes int32.)"""
    rng = np.random.default_rng(0)
    f = np.dtype(dtype)
    codes = rng.integers(-127, 128, (K, C, 3, 3)).astype(np.int8)

    def const(value, name):
        return numpy_helper.from_array(np.asarray(value, np.float16).astype(f), name)

    inits = [
        numpy_helper.from_array(codes, "wq"),
        const(rng.uniform(0.002, 0.004, K), "ws"),
        numpy_helper.from_array(np.zeros(K, np.int8), "wz"),
        const(rng.uniform(-0.2, 0.2, K), "b"),
        const(X_SCALE, "xs"),
        numpy_helper.from_array(np.array(0, np.int8), "xz"),
        const(Y_SCALE, "ys"),
        numpy_helper.from_array(np.array(-128, np.int8), "yz"),
    ]
    half = f == np.float16
    nodes = [
        helper.make_node("QuantizeLinear", ["x16" if half else "x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
        helper.make_node(
            "Conv",
            ["xd", "wd", "b"] if bias else ["xd", "wd"],
            ["c"],
            name="conv",
            pads=[1, 1, 1, 1],
        ),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("QuantizeLinear", ["r", "ys", "yz"], ["rq"]),
        helper.make_node("DequantizeLinear", ["rq", "ys", "yz"], ["y16" if half else "y"]),
    ]
    if half:
        nodes.insert(0, helper.make_node("Cast", ["x"], ["x16"], "in_cast", to=TensorProto.FLOAT16))
        nodes.append(helper.make_node("Cast", ["y16"], ["y"], "out_cast", to=TensorProto.FLOAT))
    graph = helper.make_graph(
        nodes,
        "modelopt_like_fp16_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", C, H, H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", K, H, H])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(model, full_check=True)
    return model
