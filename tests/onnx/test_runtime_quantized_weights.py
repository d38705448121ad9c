"""Weights stored float and quantized at run time (``W -> QuantizeLinear -> DequantizeLinear``,
NVIDIA ModelOpt's ONNX PTQ): ``onnx/importer/_const_quantize`` computes their codes once, so
``inspect`` counts int8 weights, ``fold`` writes integer operators ONNX Runtime runs with int8
kernels, ``lower`` lowers and ``import_onnx`` reads the codes. Before, inspect counted such a
weight neither int8 nor float and fold left every such conv in QDQ form (ORT ran it in float).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from float16_files import conv_file
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from runtime_weight_files import C, H, cnn_file, weight_nodes

import quantbridge as qb
from quantbridge.onnx.importer._const_quantize import fold_constant_quantize
from quantbridge.onnx.inspector._inspect import inspect_model
from quantbridge.onnx.passes._fold import fold

FORMS = [(np.int8, True), (np.int8, False), (np.uint8, False)]
FORM_IDS = ["int8-per-channel", "int8-per-tensor", "uint8-per-tensor"]


def _weight_graph(qtype, per_channel, scale_dtype):
    """W -> Q -> DQ -> y, W holding ties (k + 0.5 steps) and values past the grid's ends."""
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.2, (4, 3, 3, 3)).astype(np.float32)
    nodes, inits = weight_nodes("w", w, per_channel, qtype, scale_dtype)
    scale = numpy_helper.to_array(inits[1]).astype(np.float32).reshape(-1, 1, 1, 1)
    ties = (np.arange(-4, 4) + 0.5).astype(np.float32)
    w = w.copy()
    w[:, 0, 0, :] = ties[:3] * scale[:, :, 0, 0]  # exact ties for the scales chosen
    w[:, 1, 0, 0] = 300 * scale.ravel()  # past qmax, saturates
    w[:, 1, 0, 1] = -300 * scale.ravel()
    inits[0] = numpy_helper.from_array(w.astype(scale_dtype), "w")
    vi = helper.make_tensor_value_info("w_dq", TensorProto.FLOAT16 if scale_dtype == np.float16
                                       else TensorProto.FLOAT, None)  # fmt: skip
    graph = helper.make_graph(nodes, "w", [], [vi], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("qtype,per_channel", FORMS + [(np.uint8, True)],
                         ids=FORM_IDS + ["uint8-per-channel"])  # fmt: skip
def test_codes_equal_the_reference_quantize(qtype, per_channel, scale_dtype):
    model = _weight_graph(qtype, per_channel, scale_dtype)
    folded = fold_constant_quantize(model)
    assert [n.op_type for n in folded.graph.node] == ["DequantizeLinear"]
    inits = {t.name: numpy_helper.to_array(t) for t in folded.graph.initializer}
    assert "w" not in inits  # the float weight is gone (nothing else reads it)
    # oracle: onnx.reference's QuantizeLinear on the float32-widened weight and scale (ONNX
    # Runtime divides float16 in float32 too; every float16 is exact in float32); no input here
    # reaches its int32 wrap (|w / s| <= 300)
    src = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    q = model.graph.node[0]
    ref = ReferenceEvaluator(helper.make_model(helper.make_graph(
        [q], "q", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in q.input[:2]]
        + [helper.make_tensor_value_info(q.input[2], helper.np_dtype_to_tensor_dtype(
            src[q.input[2]].dtype), None)],
        [helper.make_tensor_value_info(q.output[0], TensorProto.UNDEFINED, None)],
    ), opset_imports=[helper.make_opsetid("", 19)]))  # fmt: skip
    (expected,) = ref.run(None, {
        "w": src["w"].astype(np.float32),
        "w_scale": src["w_scale"].astype(np.float32),
        "w_zp": src["w_zp"],
    })  # fmt: skip
    assert inits["w_q"].dtype == qtype
    np.testing.assert_array_equal(inits["w_q"], expected)
    info = np.iinfo(qtype)
    assert {info.min, info.max} <= set(np.unique(inits["w_q"]).tolist())  # saturation exercised


def _ort(model_or_path, x, optimized_path=None):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if optimized_path is not None:
        so.optimized_model_filepath = str(optimized_path)
    src = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) \
        else str(model_or_path)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )[0]


@pytest.mark.parametrize("qtype,per_channel", FORMS, ids=FORM_IDS)
def test_inspect_fold_lower_import(qtype, per_channel, tmp_path):
    model = cnn_file(qtype, per_channel)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    x = np.random.default_rng(1).normal(0, 1, (2, C, H, H)).astype(np.float32)
    expected = _ort(path, x)
    step = 0.05  # the output's scale (cnn_file): 1 LSB

    report = inspect_model(path)
    assert [w.dtype for w in report.weights] == [np.dtype(qtype).name] * 3
    assert not any(w.is_float for w in report.weights)

    folded = fold(path, tmp_path / "f.onnx")
    ops = [n.op_type for n in folded.graph.node]
    assert ops.count("QLinearConv") == 2 and "QGemm" in ops and "Conv" not in ops
    optimized = tmp_path / "opt.onnx"
    got = _ort(tmp_path / "f.onnx", x, optimized)
    kept = [n.op_type for n in onnx.load(optimized).graph.node]
    assert kept.count("QLinearConv") == 2 and "Conv" not in kept and "FusedConv" not in kept
    # QLinearConv / QGemm requantize as ORT's QDQ fusion of the original does, with an int32
    # bias rounded at the accumulator step: at most 1 LSB apart by design
    assert np.abs(got - expected).max() <= step * 1.0001

    prog = qb.lower(path)
    (lowered,) = prog.run({"x": x}).values()
    assert np.abs(lowered - expected).max() <= step * 1.0001  # fixed-point vs float requantize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = qb.import_onnx(path)
    with torch.no_grad():
        imported = q(torch.from_numpy(x)).numpy()
    # float simulation vs ORT's unfused QDQ run: at most 1 LSB (a tie-side flip)
    assert np.abs(imported - expected).max() <= step * 1.0001


def test_float16_file_with_runtime_weights_folds(tmp_path):
    """ModelOpt's fp16 mode: float16 weights and scales quantized at run time."""
    model = conv_file(np.float16)
    inits = {t.name: t for t in model.graph.initializer}
    codes = numpy_helper.to_array(inits["wq"]).astype(np.float32)
    scale = numpy_helper.to_array(inits["ws"]).astype(np.float32)
    w = (codes * scale.reshape(-1, 1, 1, 1)).astype(np.float16)  # lands on the codes again
    inits["wq"].CopyFrom(numpy_helper.from_array(w, "wfloat"))
    q = helper.make_node("QuantizeLinear", ["wfloat", "ws", "wz"], ["wq"], "wQ", axis=0)
    model.graph.node.insert(0, q)
    onnx.save(model, tmp_path / "m.onnx")
    folded = fold_constant_quantize(model)
    got = {t.name: numpy_helper.to_array(t) for t in folded.graph.initializer}["wq"]
    np.testing.assert_array_equal(got, codes.astype(np.int8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fold(tmp_path / "m.onnx")
    assert "QLinearConv" in [n.op_type for n in out.graph.node]


def test_not_applied_to_an_activation_quantizer():
    model = cnn_file()
    folded = fold_constant_quantize(model)
    ops = [n.op_type for n in folded.graph.node]
    assert ops.count("QuantizeLinear") == 5  # x, r1, r2, s, g stay; the 3 weight Qs are codes
    assert fold_constant_quantize(folded) is folded


def test_compare_pairs_the_activations_not_the_runtime_weights(tmp_path):
    """``compare`` with the default engines on a ModelOpt-style file: the five activations are
    paired in every engine (the integer ones with ONNX Runtime's ``ort-ref`` within 1 LSB, a
    tie-side flip of the int32 bias rounding as in ``test_inspect_fold_lower_import``), and the
    three weights quantized at run time are neither sites nor "not matched" (they were reported
    unmatched in torch-float, torch-quant, ort-qop and integer, which hold them as codes)."""
    path = tmp_path / "m.onnx"
    onnx.save(cnn_file(), path)
    x = np.random.default_rng(1).normal(0, 1, (2, C, H, H)).astype(np.float32)
    # the default engines less openvino (~3 s of its compile here; it held these weights'
    # tensors and never listed them, and tests/debug/test_compare.py runs it)
    engines = ["ort-ref", "torch-float", "torch-quant", "ort", "ort-qop", "integer"]
    data = qb.compare(str(path), inputs={"x": x}, engines=engines).to_json()
    assert data["errors"] == {} and data["unmatched"] == {}
    assert [t["name"] for t in data["tensors"]] == ["xd_q", "r1d_q", "r2d_q", "sd_q", "y_q"]
    quantized = {"ort", "ort-qop", "integer", "torch-quant"}
    assert quantized | {"ort-ref", "torch-float"} <= set(data["engines"])
    for t in data["tensors"]:
        pairs = {p["b"]: p for p in t["pairs"]}
        assert quantized | {"torch-float"} <= set(pairs), (t["name"], sorted(pairs))
        for engine in quantized:
            assert pairs[engine]["max_lsb"] <= 1.0 + 1e-3, (t["name"], pairs[engine])
