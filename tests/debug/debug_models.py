"""Models of the debug-layer tests, in a module of its own (not the conftest): every test
directory has a ``conftest.py``, and ``from conftest import`` gets whichever one pytest loaded
last (``pytest tests/debug tests/onnx`` loads tests/onnx's after this one)."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper


class ResidualCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        y = torch.relu(self.conv2(y)) + y
        return self.fc(torch.flatten(y, 1))


def conv_1x1_qdq(s_in: float, s_w: float, s_out: float, shape=(1, 1, 16, 16)) -> onnx.ModelProto:
    """x -> Q(s_in) -> DQ -> Conv(1x1, weight code 1 at scale s_w) -> Q(s_out) -> DQ: the output
    code is round(q_in * s_in * s_w / s_out), so s_in * s_w / s_out = 1/2 puts every odd input
    code on an exact tie."""

    def init(name, value):
        return numpy_helper.from_array(np.asarray(value), name)

    inits = [
        init("s_in", np.float32(s_in)), init("z_in", np.uint8(0)),
        init("w", np.ones((1, 1, 1, 1), np.int8)), init("s_w", np.float32(s_w)),
        init("z_w", np.int8(0)), init("s_out", np.float32(s_out)), init("z_out", np.uint8(0)),
    ]  # fmt: skip
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s_in", "z_in"], ["xq"], name="quant_x"),
        helper.make_node("DequantizeLinear", ["xq", "s_in", "z_in"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "s_w", "z_w"], ["wd"]),
        helper.make_node("Conv", ["xd", "wd"], ["y"], name="conv"),
        helper.make_node("QuantizeLinear", ["y", "s_out", "z_out"], ["yq"], name="quant_y"),
        helper.make_node("DequantizeLinear", ["yq", "s_out", "z_out"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_1x1",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, list(shape))],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model
