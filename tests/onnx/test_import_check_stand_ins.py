"""The import-time dynamic-dimension check (``_symbolic.check_at_import``) lets elementwise ops
stand in for themselves (``STAND_INS``): the same output shapes and dtypes as running the ops on
the fake tensors, and the same pins (broadcasting against a constant of fixed size still pins
the dimension, and the warning names that node)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import quantbridge as qb
from quantbridge.onnx.importer._symbolic import STAND_INS, DynamicDimensionWarning, _fake_input


def _model(nodes, consts, shape, opset=13) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(v, k) for k, v in consts.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _elementwise_chain() -> onnx.ModelProto:
    """Every stand-in kind: unary ops, a scalar operand, per-channel and full broadcasts,
    softmax and batch norm."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Clip", ["r", "lo", "hi"], ["c"]),
        helper.make_node("Mul", ["c", "half"], ["m"]),
        helper.make_node("Add", ["m", "bias"], ["a"]),  # [3, 1, 1]: per channel
        helper.make_node("Sub", ["channel", "a"], ["s"]),  # [1, 3, 1, 1] - [b, 3, h, w]
        helper.make_node("Div", ["s", "x"], ["d"]),
        helper.make_node("HardSigmoid", ["d"], ["h"]),
        helper.make_node("Softmax", ["h"], ["p"], axis=1),
        helper.make_node("BatchNormalization", ["p", "gamma", "beta", "mean", "var"], ["n"]),
        helper.make_node("Mul", ["n", "x"], ["y"]),
    ]
    consts = {
        "lo": np.array(0.0, np.float32),
        "hi": np.array(6.0, np.float32),
        "half": np.array(0.5, np.float32),
        "bias": np.arange(3, dtype=np.float32).reshape(3, 1, 1),
        "channel": np.ones((1, 3, 1, 1), np.float32),
        **{
            k: np.full(3, v, np.float32)
            for k, v in (("gamma", 2), ("beta", 0), ("mean", 0), ("var", 1))
        },
    }
    return _model(nodes, consts, ["batch", 3, "h", "w"])


def _fake_run(proto, stand_ins):
    module = qb.import_onnx(proto, check_dynamic=False)
    mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False), allow_non_fake_inputs=True)
    x = _fake_input(mode, proto.graph.input[0], {0: "batch", 2: "h", 3: "w"}, None)
    with mode, torch.no_grad():
        return module.run({"x": x}, stand_ins=stand_ins)


def test_stand_ins_give_the_shapes_and_dtypes_the_ops_give():
    proto = _elementwise_chain()
    ran, stood_in = _fake_run(proto, None), _fake_run(proto, STAND_INS)
    assert [str(s) for s in stood_in.shape] == [str(s) for s in ran.shape]
    assert stood_in.dtype == ran.dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error", DynamicDimensionWarning)
        module = qb.import_onnx(proto)  # nothing pins: silent
    x = torch.randn(3, 3, 5, 7)
    assert module(x).shape == (3, 3, 5, 7)


@pytest.mark.parametrize("op", ["Add", "Mul"])
def test_broadcast_against_a_fixed_constant_still_pins_and_is_named(op):
    """``x[batch, 4] + c[2, 4]`` only runs at batch 2 (or 1): the stand-in broadcasts as the op
    does, so the check says so at import, naming the node."""
    nodes = [helper.make_node(op, ["x", "c"], ["y"], name="with_pair")]
    proto = _model(nodes, {"c": np.ones((2, 4), np.float32)}, ["batch", 4])
    with pytest.warns(
        DynamicDimensionWarning, match=rf"'with_pair' \(op {op}.*dimension 0 of input 'x'.*to 2"
    ):
        qb.import_onnx(proto)
