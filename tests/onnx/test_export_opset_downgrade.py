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


# ---- Resize's opset-18 attributes (import sweep, 2026-12-02) -------------------------------------
# torch's exporter writes antialias=0 and keep_aspect_ratio_policy="stretch" on every
# F.interpolate; re-exporting an imported opset-17 file holding a Resize (ConvTranspose ->
# Resize -> Concat decoders) failed the schema check ("Unrecognized attribute:
# keep_aspect_ratio_policy for operator Resize").
def _resize_model(**attrs) -> onnx.ModelProto:
    scales = helper.make_tensor("scales", TensorProto.FLOAT, [4], [1, 1, 2, 2])
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], name="up", mode="nearest",
                            coordinate_transformation_mode="asymmetric", nearest_mode="floor",
                            **attrs)  # fmt: skip
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3, 5, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 3, 10, 14])], [scales],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_neutral_resize_attributes_are_dropped_below_opset_18():
    """The opset-17 Resize computes what the opset-18 one does, exactly (nearest: copies)."""
    model = _resize_model(antialias=0, keep_aspect_ratio_policy="stretch")
    low = downgrade(model, 17)
    onnx.checker.check_model(low, full_check=True)
    assert {a.name for a in low.graph.node[0].attribute} == {
        "mode", "coordinate_transformation_mode", "nearest_mode"
    }  # fmt: skip
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 7)).astype(np.float32)
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
           for m in (model, low)]  # fmt: skip
    np.testing.assert_array_equal(run[1].run(None, {"x": x})[0], run[0].run(None, {"x": x})[0])


@pytest.mark.parametrize(
    "attrs, what", [({"antialias": 1}, "antialias"),
                    ({"keep_aspect_ratio_policy": "not_larger"}, "keep_aspect_ratio_policy")],
)  # fmt: skip
def test_resize_attributes_that_change_the_result_are_refused(attrs, what):
    with pytest.raises(ValueError, match=rf"Resize 'up': attribute {what} needs opset >= 18"):
        downgrade(_resize_model(**attrs), 17)


# ---- LSTM / GRU / RNN layout (import sweep, 2026-12-03) ------------------------------------------
# The torch exporter writes layout=0 on every recurrent op (opset 14 added it); re-exporting an
# imported opset-13 file holding an LSTM and a GRU failed ("ValidationError: Unrecognized
# attribute: layout for operator LSTM").
def _recurrent_model(op: str, layout: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    w = helper.make_tensor("W", TensorProto.FLOAT, [1, gates * 4, 3],
                           rng.standard_normal(gates * 12).astype(np.float32))  # fmt: skip
    r = helper.make_tensor("R", TensorProto.FLOAT, [1, gates * 4, 4],
                           rng.standard_normal(gates * 16).astype(np.float32))  # fmt: skip
    node = helper.make_node(op, ["x", "W", "R"], ["y"], name="rec", hidden_size=4, layout=layout)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 1, 2, 4])], [w, r],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_time_major_recurrent_layout_is_dropped_below_opset_14(op):
    """layout=0 is opset 13's only layout: the opset-13 op computes the same, bit for bit."""
    model = _recurrent_model(op, 0)
    low = downgrade(model, 13)
    onnx.checker.check_model(low, full_check=True)
    assert "layout" not in {a.name for a in low.graph.node[0].attribute}
    x = np.random.default_rng(1).standard_normal((5, 2, 3)).astype(np.float32)
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
           for m in (model, low)]  # fmt: skip
    np.testing.assert_array_equal(run[1].run(None, {"x": x})[0], run[0].run(None, {"x": x})[0])


def test_batch_major_recurrent_layout_is_refused_below_opset_14():
    with pytest.raises(ValueError, match=r"LSTM 'rec': attribute layout needs opset >= 14"):
        downgrade(_recurrent_model("LSTM", 1), 13)
