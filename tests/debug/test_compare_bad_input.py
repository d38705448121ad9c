"""Issue 11 "Bad input": wrong input names, wrong shapes, two files of different structure, an
engine that cannot load the model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from debug_models import conv_1x1_qdq
from onnx import helper

import quantbridge as qb


def test_inputs_that_match_no_model_input_name_the_expected_ones(cnn):
    path, _, inputs = cnn
    with pytest.raises(
        ValueError, match=r"do not match the model's inputs \['x'\].*missing \['x'\]"
    ):
        qb.compare(path, inputs={"image": inputs["x"]})


def test_shape_mismatch_names_the_input_and_the_expected_shape(cnn):
    path, _, _ = cnn
    bad = np.zeros((2, 3, 9, 8), np.float32)
    with pytest.raises(ValueError, match=r"input 'x' has shape \(2, 3, 9, 8\).*\('\?', 3, 8, 8\)"):
        qb.compare(path, inputs={"x": bad})


def test_a_negative_dim_value_is_a_dynamic_size():
    """Paddle's exporter declares the batch as ``dim_value: -1`` (PP-OCR's classifier); ONNX
    Runtime runs any batch there, so compare must not refuse a batch of 2 as a shape mismatch."""
    model = conv_1x1_qdq(0.1, 1.0, 0.2)
    for v in (*model.graph.input, *model.graph.output):
        v.type.tensor_type.shape.dim[0].dim_value = -1
    x = np.linspace(0, 1, 512, dtype=np.float32).reshape(2, 1, 16, 16)
    r = qb.compare(model, inputs={"x": x}, engines=["ort-ref"])
    assert r.errors == {} and r.tensors


def test_a_float_model_alone_is_refused_with_the_fix(tmp_path):
    model = conv_1x1_qdq(0.1, 1.0, 0.2)
    floats = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["out"])], "f", list(model.graph.input),
        list(model.graph.output),
    )  # fmt: skip
    with pytest.raises(ValueError, match="compare needs a quantized model"):
        qb.compare(helper.make_model(floats), inputs={"x": np.zeros((1, 1, 16, 16), np.float32)})


def _rename(model: onnx.ModelProto, old: str, new: str) -> None:
    for n in model.graph.node:
        n.input[:] = [new if i == old else i for i in n.input]
        n.output[:] = [new if o == old else o for o in n.output]


def test_different_structures_report_unmatched_and_compare_the_rest(cnn):
    path, _, inputs = cnn
    other = onnx.load(path)
    q = next(n for n in other.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "relu")
    renamed = q.output[0]
    _rename(other, renamed, "other_tool_q")
    _rename(other, "relu", "other_tool_relu")  # no name, no source in common: unmatched
    r = qb.compare(path, other, inputs=inputs)
    assert r.errors == {}
    assert r.unmatched == {"b:ort-ref": [renamed]}
    compared = [t for t in r.tensors if t["pairs"]]
    assert len(compared) == len(r.tensors) - 1
    assert all(p["class"] == "exact" for t in compared for p in t["pairs"])  # same numbers
    assert renamed in str(r)


def _qdq_with_unlowerable_op() -> onnx.ModelProto:
    """x -> Q -> DQ -> Hardmax -> Q -> DQ: ONNX Runtime runs it, the integer lowering has no
    Hardmax (Sin was the example until the lowering learnt it as a table)."""
    model = conv_1x1_qdq(0.1, 1.0, 0.2)
    for n in model.graph.node:
        if n.op_type == "Conv":
            n.op_type, n.name = "Hardmax", "hardmax"
            del n.input[1:]
    return model


def test_an_engine_that_fails_to_load_is_reported_and_the_others_continue():
    model = _qdq_with_unlowerable_op()
    x = np.linspace(-1, 1, 256, dtype=np.float32).reshape(1, 1, 16, 16) + 1.0
    r = qb.compare(model, inputs={"x": x}, engines=["ort-ref", "integer", "ort"])
    assert list(r.errors) == ["integer"] and "Hardmax" in r.errors["integer"]
    assert r.to_json()["engines"] == ["ort-ref", "ort"]
    assert all([p["b"] for p in t["pairs"]] == ["ort"] for t in r.tensors)
    assert "engine integer failed" in str(r)


def test_unknown_engine_lists_the_known_ones(cnn):
    path, _, inputs = cnn
    with pytest.raises(ValueError, match="unknown engine 'tensorrtx'; known engines: torch-float"):
        qb.compare(path, inputs=inputs, engines=["ort-ref", "tensorrtx"])


def test_tensorrt_without_a_gpu_is_skipped_with_the_reason(cnn):
    """TensorRT is optional: asked for where ORT has no TensorRT provider (this CPU machine), its
    row says why and what to install; by default it is not even tried."""
    import onnxruntime as ort

    path, _, inputs = cnn
    if "TensorrtExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has TensorRT: the engine runs (covered by the compare tests)")
    r = qb.compare(path, inputs=inputs, engines=["ort-ref", "tensorrt"])
    assert list(r.errors) == ["tensorrt"]
    assert "skipped: TensorRT needs an NVIDIA GPU" in r.errors["tensorrt"]
    assert "onnxruntime-gpu" in r.errors["tensorrt"]
    assert r.to_json()["engines"] == ["ort-ref"]
    default = qb.compare(path, inputs=inputs)
    assert "tensorrt" not in default.to_json()["engines"] and "tensorrt" not in default.errors
