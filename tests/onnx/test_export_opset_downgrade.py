"""``onnx.exporter._opset.downgrade`` of opset 15's ``Shape(start, end)`` (toolfiles sweep,
2026-12-02): the torch exporter writes it for a batch size, so re-exporting an imported opset-14
file (a TorchScript-exported BERT quantized by ONNX Runtime) failed the schema check
("Unrecognized attribute: end for operator Shape")."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from quantbridge.onnx.exporter._opset import downgrade


def _model(**bounds) -> onnx.ModelProto:
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape", **bounds),
             helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT)]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3, 5, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": np.zeros((2, 3, 5, 7), np.float32)})[0]


@pytest.mark.parametrize("bounds", [{"end": 1}, {"start": 1}, {"start": -3, "end": -1}, {}])
def test_shape_bounds_become_a_slice_below_opset_15(bounds):
    """ORT gives the opset-14 form the opset-18 form's output exactly (integers)."""
    model = _model(**bounds)
    low = downgrade(model, 14)
    onnx.checker.check_model(low, full_check=True)
    assert all(not n.attribute for n in low.graph.node if n.op_type == "Shape")
    np.testing.assert_array_equal(_run(low), _run(model))
