"""``import_onnx`` of quantized files in the forms other tools write, each built here with
``onnx.helper`` to the tool's exact node pattern (no tool needed to run the tests).

* QLinearSoftmax (com.microsoft) whose ``opset`` attribute differs from the model's: ONNX
  Runtime's quantizer writes the float model's opset there (and copies ``axis`` only when the
  Softmax has one); below 13 the kernel flattens the input to 2-D at ``axis``. A missing axis is
  -1 at every opset (the contrib schema's default; measured on ORT 1.32, which so runs an opset-12
  model's quantized Softmax over the last axis, unlike its float model).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb

ort = pytest.importorskip("onnxruntime")


def _softmax_file(path, softmax_opset: int, model_opset: int = 17, **attrs) -> str:
    """x -> QuantizeLinear(u8) -> QLinearSoftmax(opset=softmax_opset) -> DequantizeLinear -> y."""
    inits = [numpy_helper.from_array(np.array(v, dtype), n) for n, v, dtype in
             [("xs", 0.05, np.float32), ("xz", 128, np.uint8),
              ("ys", 1 / 256, np.float32), ("yz", 0, np.uint8)]]  # fmt: skip
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q"),
        helper.make_node("QLinearSoftmax", ["xq", "xs", "xz", "ys", "yz"], ["yq"], name="sm",
                         domain="com.microsoft", opset=softmax_opset, **attrs),
        helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"], name="dq"),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "softmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])], inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", model_opset), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.save(model, path)
    return str(path)


@pytest.mark.parametrize(
    "softmax_opset, model_opset, attrs",
    [(12, 17, {}), (12, 17, {"axis": 2}), (12, 17, {"axis": 0}), (12, 17, {"axis": 1}),
     (13, 17, {}), (13, 17, {"axis": 1}), (11, 11, {}), (11, 11, {"axis": 1}), (13, 12, {})],
)  # fmt: skip
def test_qlinear_softmax_keeps_its_own_opset_semantics(tmp_path, softmax_opset, model_opset, attrs):
    """Torch on the imported model, and the lowered program, against ORT's QLinearSoftmax kernel
    in output steps (1/256). Measured: at most 1 step (ORT's kernel is a float exp table times
    floor(1 / y_scale), the _unfold docstring); the wrong semantics are off by tens of steps (a
    softmax over 12 or 6 values against one over 4). Before the fix: (12, 17, axis 0 or 1)
    imported as one-axis softmaxes, (11, 11, no axis) as a flatten at axis 1, and (12, 17) /
    (13, 12) with no axis (ORT's own quantizer output for an opset-12 model) were refused."""
    path = _softmax_file(tmp_path / "sm.onnx", softmax_opset, model_opset, **attrs)
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32) * 2
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ours = qb.import_onnx(path)(torch.from_numpy(x)).detach().numpy()
    assert np.abs(ours - ref).max() * 256 <= 1.0 + 1e-6
    if "axis" in attrs:
        return  # lower refuses these, naming the node (a last-axis softmax of its own opset only)
    (lowered,) = qb.lower(onnx.load(path)).run({"x": x}).values()
    assert np.abs(lowered - ref).max() * 256 <= 1.0 + 1e-6


def test_opset13_softmax_in_an_opset12_model_is_refused_with_the_fix(tmp_path):
    path = _softmax_file(tmp_path / "sm.onnx", 13, model_opset=12, axis=1)
    with pytest.raises(ValueError, match=r"'sm'.*opset-13 Softmax semantics.*re-export"):
        qb.import_onnx(path)
