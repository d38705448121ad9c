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


TIE_S_IN, TIE_S = 0.1, 0.2  # tie_prefix's input and output steps


def tie_prefix(tie_s_w: float = 1.0) -> tuple[list, list]:
    """(initializers, nodes) of x[1, 2, ...] -> Q(``TIE_S_IN``) -> DQ -> depthwise 1x1 Conv
    (weight code 1 at ``tie_s_w``) -> Q(``TIE_S``) -> DQ ``td``: at ``tie_s_w`` = 1 the output
    code is round(q / 2), an exact tie at every odd input code (1 + 1e-6 rounds them up). Names
    the models built on it may read: ``td``, zero points ``z_u8`` (uint8) and ``z_w`` (int8)."""

    def init(name, value):
        return numpy_helper.from_array(np.asarray(value), name)

    inits = [
        init("s_in", np.float32(TIE_S_IN)), init("z_u8", np.uint8(0)),
        init("w_tie", np.ones((2, 1, 1, 1), np.int8)), init("s_wt", np.float32(tie_s_w)),
        init("z_w", np.int8(0)), init("s_tie", np.float32(TIE_S)),
    ]  # fmt: skip
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s_in", "z_u8"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s_in", "z_u8"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w_tie", "s_wt", "z_w"], ["wtd"]),
        helper.make_node("Conv", ["xd", "wtd"], ["t"], group=2, name="tie"),
        helper.make_node("QuantizeLinear", ["t", "s_tie", "z_u8"], ["tq"], name="quant_tie"),
        helper.make_node("DequantizeLinear", ["tq", "s_tie", "z_u8"], ["td"]),
    ]
    return inits, nodes


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
