"""Resize at opset 10 (``Resize(x, scales)``, Upsample-9's semantics renamed: asymmetric
coordinates, nearest = floor, output size ``floor(size * scale)``), as torch's TorchScript
exporter writes ``F.interpolate`` at opset 10. Import sweep of 2026-12-03 (an up-convolution
model exported at opset 10, quantized by ONNX Runtime): ``qb.import_onnx`` refused the file
("unsupported ops Resize": the import knew Resize from opset 11 on) and ``qb.lower`` read the
scales from input 2 ("scales or sizes must be constants")."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import quantbridge as qb

SCALES = [1.0, 1.0, 1.5, 2.5]  # non-integer: floor(i / scale) picks uneven runs of rows


def _file(mode: str = "nearest") -> onnx.ModelProto:
    """x -> Q/DQ (uint8) -> Resize-10 -> Q/DQ -> y, opset 10."""
    inits = [helper.make_tensor("s", TensorProto.FLOAT, [], [0.05]),
             helper.make_tensor("z", TensorProto.UINT8, [], [128]),
             helper.make_tensor("scales", TensorProto.FLOAT, [4], SCALES)]  # fmt: skip
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q0"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq0"),
        helper.make_node("Resize", ["xd", "scales"], ["r"], name="up", mode=mode),
        helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"], name="q1"),
        helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["y"], name="dq1"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 7, 15])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 10)])
    model.ir_version = 6
    return model


def _ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_resize10_imports_and_lowers_exactly():
    """Nearest resizing moves codes: the import and the integer program give ONNX Runtime's
    output bit for bit (0 LSB)."""
    model = _file()
    x = np.random.default_rng(0).uniform(-6, 6, (2, 3, 5, 6)).astype(np.float32)
    expected = _ort(model, x)
    qmodel = qb.import_onnx(model)
    with torch.no_grad():
        got = qmodel(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, expected)
    (low,) = qb.lower(model).run({"x": x}).values()
    np.testing.assert_array_equal(np.asarray(low, np.float32), expected)


def test_resize10_linear_names_the_fix():
    """Linear at opset 10 samples asymmetric coordinates, which no torch mode does."""
    with pytest.raises(ValueError, match=r"Resize mode 'linear'.*opset >= 11"):
        qb.import_onnx(_file("linear"))
