"""``qb.compare`` on a small residual CNN: every engine runs, captures every quantized tensor,
and the integer engines agree within the documented classes; the JSON has the contract's shape."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from debug_models import ResidualCNN

import quantbridge as qb
from quantbridge.debug._engines import OnnxCapture
from quantbridge.debug._match import find_sites
from quantbridge.debug._subject import torch_args
from quantbridge.onnx import to_onnx

QUANTIZED_ENGINES = ("ort-ref", "ort", "ort-qop", "integer", "torch-quant", "openvino")


@pytest.fixture(scope="module")
def result(cnn):
    path, _, inputs = cnn
    return qb.compare(path, inputs=inputs)


def test_every_engine_runs_and_quantized_engines_agree_within_one_lsb(result, cnn):
    data = result.to_json()
    assert data["errors"] == {}
    assert data["reference"] == "ort-ref"
    assert set(data["engines"]) == {"ort-ref", "torch-float", *QUANTIZED_ENGINES}
    sites = find_sites(onnx.load(cnn[0]))
    assert [t["name"] for t in data["tensors"]] == [s.name for s in sites]
    classes = Counter()
    for t in data["tensors"]:
        for p in t["pairs"]:
            classes[p["b"], p["class"]] += 1
            if p["b"] == "torch-float":
                assert p["class"] in ("quantization noise", "exact")
            else:
                # 7-bit weights: every engine's integer result is exact or one tie away
                assert p["class"] in ("exact", "rounding"), (t["name"], p)
                assert p["max_lsb"] <= 1.0 + 1e-3
    # every engine compared at least the conv, add and gemm outputs
    for engine in ("torch-float", *QUANTIZED_ENGINES[1:]):
        assert sum(n for (b, _), n in classes.items() if b == engine) >= 4, engine
    assert result.first_divergence is None


def test_tensors_carry_layer_names_scales_and_lsb_shares(result, cnn):
    model = onnx.load(cnn[0])
    arrays = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    scales = {k: float(v) for k, v in arrays.items() if v.size == 1}
    quantize = {n.output[0]: n for n in model.graph.node if n.op_type == "QuantizeLinear"}
    for t in result.tensors:
        q = quantize[t["name"]]
        assert t["scale"] == pytest.approx(scales[q.input[1]])  # the Q node's own step
        for p in t["pairs"]:
            assert sum(p["lsb_share"].values()) == pytest.approx(1.0)
            assert -1.0 <= p["cosine"] <= 1.0
    layers = {t["name"]: t["layer"] for t in result.tensors}
    assert {"conv1/conv2d", "conv2/conv2d_1", "add", "fc/linear"} <= set(layers.values())
    json.loads(json.dumps(result.to_json(), allow_nan=False))  # plain JSON: no Infinity/NaN


def test_sites_know_the_sites_they_are_computed_from(cnn):
    sites = {s.source: s for s in find_sites(onnx.load(cnn[0])) if s.source}
    name = {src: s.name for src, s in sites.items()}
    assert sites["relu"].inputs == (name["x"],)
    assert sites["relu_1"].inputs == (name["relu"],)
    assert set(sites["add"].inputs) == {name["relu"], name["relu_1"]}
    assert sites["x"].inputs == ()
    # an error can grow through a Conv (no credit for carried errors), not through an Add
    assert sites["add"].unit_gain and not sites["relu"].unit_gain


def test_float_engine_is_measured_as_quantization_noise_against_independent_float(result, cnn):
    # torch-float's final Gemm output against the user's float model, outside quantbridge:
    # same order of magnitude as the int8 result (quantization noise, not garbage)
    fc = next(t for t in result.tensors if t["layer"] == "fc/linear")
    pair = next(p for p in fc["pairs"] if p["b"] == "torch-float")
    assert pair["class"] == "quantization noise"
    assert pair["sqnr_db"] is not None and 5.0 < pair["sqnr_db"] < 80.0


def test_optimized_session_with_capture_still_runs_the_fused_int8_kernels(cnn, tmp_path):
    model = onnx.load(cnn[0])
    capture = OnnxCapture(model, find_sites(model), "onnxruntime", {"optimization": "all"})
    counts = []
    for name, m in (("plain", model), ("capture", capture.model)):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
        ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        ops = Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)
        counts.append(ops)
    plain, captured = counts
    assert plain["QLinearConv"] == 2 and captured["QLinearConv"] == 2
    int8_ops = ("QLinearConv", "QLinearAdd", "QGemm", "QLinearMatMul", "MatMulIntegerToFloat")
    assert {k: captured[k] for k in int8_ops} == {k: plain[k] for k in int8_ops}
    assert capture.where  # and it captured the sites
    assert len(capture.model.graph.output) > len(model.graph.output)


def test_quantmodel_is_accepted_and_matched_through_the_export_record(cnn):
    _, qmodel, inputs = cnn
    r = qb.compare(qmodel, inputs=inputs["x"], engines=["ort-ref", "torch-quant", "torch-float"])
    assert r.errors == {}
    # every quantizer's output is matched (the Reshape's requantization shares add's quantizer)
    model = onnx.load(cnn[0])
    sources = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    by_source = {sources[t["name"]]: {p["b"]: p for p in t["pairs"]} for t in r.tensors}
    assert set(r.unmatched) <= {"torch-quant", "torch-float"}
    assert all(sources[name] == "flatten" for name in sum(r.unmatched.values(), []))
    for source in ("x", "relu", "relu_1", "add", "linear"):
        assert by_source[source]["torch-quant"]["class"] in ("exact", "rounding"), source
        assert by_source[source]["torch-float"]["class"] in ("quantization noise", "exact")


def test_result_table_worst_and_dataframe(result):
    worst = result.worst(3)
    assert len(worst) == 3
    keys = [(w["max_lsb"] or -1.0) for w in worst]
    assert keys == sorted(keys, reverse=True)  # one class here: by steps of error
    assert all(w["class"] == "quantization noise" for w in worst)
    assert worst[0]["b"] == "torch-float"  # float is the furthest from the int8 reference
    text = str(result)
    assert "first divergence: none" in text and "torch-float" in text
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install pandas"):
            result.to_dataframe()
    else:
        assert len(result.to_dataframe()) == len(result.rows())


def test_streaming_keeps_one_engine_at_a_time(cnn):
    # the result holds metrics only, no captured arrays
    path, _, inputs = cnn
    r = qb.compare(path, inputs=inputs, engines=["ort-ref", "integer"])
    for t in r.tensors:
        for p in t["pairs"]:
            assert not any(isinstance(v, np.ndarray) for v in p.values())


def test_float_file_against_its_quantized_file_is_quantization_noise(cnn):
    path, qmodel, inputs = cnn
    with qb.float_mode(qmodel):  # the QuantModel's fp32 form, by the same export path
        float_model = to_onnx(qmodel, torch_args(inputs, None))
    assert not any(n.op_type == "QuantizeLinear" for n in float_model.graph.node)
    r = qb.compare(float_model, path, inputs=inputs)
    assert r.errors == {} and r.to_json()["reference"] == "b:ort-ref"
    pairs = [p for t in r.tensors for p in t["pairs"]]
    assert len(pairs) >= 5  # input, conv1, conv2, add, fc: matched through the Q's float input
    assert {p["class"] for p in pairs} == {"quantization noise"}
    assert all(p["cosine"] > 0.9 for p in pairs)


def test_plain_float_torch_module_gives_its_outputs(cnn):
    path, qmodel, inputs = cnn
    # a different float model of the same structure: only outputs are matched, by position
    r = qb.compare(ResidualCNN().eval(), path, inputs=inputs)
    assert r.errors == {}
    compared = [t for t in r.tensors if t["pairs"]]
    assert [t["layer"] for t in compared] == ["fc/linear"]  # the model output, by position
    assert compared[0]["pairs"][0]["b"] == "a:torch-float"
    assert compared[0]["pairs"][0]["class"] == "quantization noise"


class _KeywordFlag(torch.nn.Module):
    """Called as GPT-2 is: keyword tensors and a plain flag (``use_cache=False``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

    def forward(self, x, mask, use_cache=None):
        return {"logits": self.fc2(self.fc1(x).relu() * mask) * (1.0 if use_cache else 2.0)}


@pytest.mark.parametrize("flag", [{"use_cache": False}, {}])
def test_quantmodel_called_with_keywords_and_a_plain_flag(flag):
    # regression: a dict of inputs was exported positionally in dict order and a plain value
    # became a tensor (torch's "data-dependent expression" error); without it, torch-quant
    # called the QuantModel without its captured use_cache ("missing a required argument")
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 8), "mask": torch.rand(4, 8), "use_cache": False}
    qmodel = qb.quantize(_KeywordFlag().eval(), [batch], recipe="int8", progress=False)
    inputs = {"mask": batch["mask"].numpy(), "x": batch["x"].numpy(), **flag}  # not forward order
    r = qb.compare(qmodel, inputs=inputs, engines=["ort-ref", "torch-quant"])
    assert r.errors == {} and r.unmatched == {}
    assert len(r.tensors) >= 4  # x, mask, fc1, the product, fc2 (Q/DQ sites)
    # torch's fake quantization and ORT's reference kernels on the same inputs: at most a
    # rounding tie apart (1 LSB), never more on a three-layer model
    assert all(p["class"] in ("exact", "rounding") for t in r.tensors for p in t["pairs"])
    assert r.first_divergence is None
