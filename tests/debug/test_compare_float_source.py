"""``qb.compare(float.onnx, quantized.onnx)`` where the quantized file does not keep the float
file's names: quantbridge's export of the torch model the float file was exported from (fx names
``relu``, ``add``, ``linear`` against TorchScript's ``/Relu_output_0``, ``/Add_output_0``, ``y``),
and ONNX Runtime's ``quantize_static`` of the float file (Relu removed, the output's producer
renamed). Every site pairs with the float tensor it approximates, by structure, and says so."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from debug_models import ResidualCNN
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb
from quantbridge.debug._match import find_sites
from quantbridge.debug._match_float import match_float_file

# float ops whose output is an activation both quantized files quantize
TWINNED = ("Relu", "Add", "Flatten", "Gemm")


@pytest.fixture(scope="module")
def files(cnn, tmp_path_factory):
    """(float file, quantbridge's QDQ file, ORT's QDQ file, inputs) of the residual CNN."""
    path, qmodel, inputs = cnn
    torch.manual_seed(0)  # the conftest fixture's float model: same seed, same weights
    model = ResidualCNN().eval()
    state = qmodel.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    folder = tmp_path_factory.mktemp("float_source")
    float_path = folder / "cnn.onnx"
    example = torch.zeros(2, 3, 8, 8)
    with warnings.catch_warnings():  # "legacy TorchScript-based ONNX export": wanted here
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(  # TorchScript exporter: '/conv1/Conv_output_0' names, none shared
            model, (example,), str(float_path), input_names=["x"], output_names=["y"],
            dynamo=False, dynamic_axes={"x": {0: "n"}},
        )  # fmt: skip
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": inputs["x"]}])

        def get_next(self):
            return next(self.batches, None)

    ort_path = folder / "cnn.ort_int8.onnx"
    quantize_static(str(float_path), str(ort_path), Reader(), quant_format=QuantFormat.QDQ)
    return float_path, path, ort_path, inputs


def _float_tensors(float_path) -> set[str]:
    graph = onnx.load(str(float_path)).graph
    return {"x"} | {n.output[0] for n in graph.node if n.op_type in TWINNED}


def test_quantbridge_export_pairs_by_structure(files):
    float_path, qdq_path, _, inputs = files
    sources = {s.source for s in find_sites(onnx.load(str(qdq_path))) if s.source != "x"}
    assert not sources & _float_tensors(float_path)  # no name to match by
    r = qb.compare(float_path, qdq_path, inputs=inputs)
    assert r.errors == {} and r.unmatched == {}
    pairs = [p for t in r.tensors for p in t["pairs"]]
    assert {p["float_tensor"] for p in pairs} == _float_tensors(float_path)
    assert sorted(p["matched_by"] for p in pairs) == ["input name"] + ["structure"] * 5
    assert {p["class"] for p in pairs} == {"quantization noise"}
    summary = "a:ort-ref: 6 tensors paired with the float file's (1 by input name; 5 by structure)"
    assert summary in str(r)


def test_ort_quantize_static_output_pairs_and_lsb_is_recomputed(files):
    float_path, _, ort_path, inputs = files
    r = qb.compare(float_path, ort_path, inputs=inputs)
    assert r.errors == {} and r.unmatched == {}
    pairs = {t["name"]: (t, p) for t in r.tensors for p in t["pairs"]}
    assert {p["float_tensor"] for _, p in pairs.values()} == _float_tensors(float_path)
    rules = [p["matched_by"] for _, p in pairs.values()]
    assert rules.count("name, structure + Relu absorbed") == 2  # ORT drops Relu before a Q
    assert "structure" in rules  # Gemm: ORT renamed its output 'y_QuantizeLinear_Input'
    # the Add's error in LSB, by hand: ORT's codes of the quantized file, dequantized in
    # float64, against the float file's Add output (found by op type, not by the matcher)
    table, pair = next(v for v in pairs.values() if v[0]["op"] == "Add")
    quantized = onnx.load(str(ort_path))
    quantized.graph.output.append(helper.make_empty_tensor_value_info(table["name"]))
    float_model = onnx.load(str(float_path))
    add = next(n.output[0] for n in float_model.graph.node if n.op_type == "Add")
    float_model.graph.output.append(helper.make_tensor_value_info(add, TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    codes = ort.InferenceSession(quantized.SerializeToString(), so).run([table["name"]], inputs)[0]
    real = ort.InferenceSession(float_model.SerializeToString(), so).run([add], inputs)[0]
    scale, zero = table["scale"], table["zero_point"]
    by_hand = np.max(np.abs((codes.astype(np.float64) - zero) * scale - real)) / scale
    assert pair["float_tensor"] == add
    assert pair["max_lsb"] == pytest.approx(by_hand, rel=1e-9)
    assert by_hand > 0.5  # a real quantization error, not a trivially equal pair


def _init(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def test_folded_batchnorm_region_and_weight_rule():
    """Float: x -> Conv -> BatchNormalization -> Relu, and x2 -> Neg -> MatMul(w1) beside
    x2 -> MatMul(w2); quantized: the BatchNormalization folded into the Conv, Neg written as
    Mul(-1) (a region: the MatMul pairs with the one whose input is computed from x2 through ops
    of no counterpart, and Mul(-1) with Neg), and a MatMul(w2) reading an input the float file
    lacks (no structure to follow: its weight pairs it, with w2, not w1)."""
    rng = np.random.default_rng(0)
    w, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((2, 2, 1, 1), (4, 3), (4, 3)))
    floats = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"]),
            helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["bn"]),
            helper.make_node("Relu", ["bn"], ["r"]),
            helper.make_node("Neg", ["x2"], ["n"]),
            helper.make_node("MatMul", ["n", "w1"], ["m1"]),
            helper.make_node("MatMul", ["x2", "w2"], ["m2"]),
        ],
        "f",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 2, 2]),
         helper.make_tensor_value_info("x2", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("r", "m1", "m2")],
        [_init("w", w), _init("g", np.ones(2, np.float32) * 2), _init("b", np.zeros(2, np.float32)),
         _init("m", np.zeros(2, np.float32)), _init("v", np.ones(2, np.float32)),
         _init("w1", w1), _init("w2", w2)],
    )  # fmt: skip
    s = 0.05  # every weight within the int8 range: |w| < 127 s
    nodes, inits = [], [_init("s", np.float32(s)), _init("z", np.int8(0))]

    def qdq(t, out):
        nodes.append(helper.make_node("QuantizeLinear", [t, "s", "z"], [out + "_q"]))
        nodes.append(helper.make_node("DequantizeLinear", [out + "_q", "s", "z"], [out]))

    def weight(name, value):  # the float weight quantized with step s
        inits.append(_init(name + "_q", np.round(value / s).astype(np.int8)))
        nodes.append(helper.make_node("DequantizeLinear", [name + "_q", "s", "z"], [name]))

    qdq("x", "xd")
    weight("fw", w * 2)  # gamma 2, var 1, mean 0: the folded weight is 2 w (eps ignored)
    nodes += [helper.make_node("Conv", ["xd", "fw"], ["conv"]),
              helper.make_node("Relu", ["conv"], ["relu"])]  # fmt: skip
    qdq("relu", "relud")
    qdq("x2", "x2d")
    inits.append(_init("minus", np.float32(-1)))
    nodes.append(helper.make_node("Mul", ["x2d", "minus"], ["neg"]))
    qdq("neg", "negd")
    weight("qw1", w1)
    nodes.append(helper.make_node("MatMul", ["negd", "qw1"], ["mm"]))
    qdq("mm", "mmd")
    qdq("x3", "x3d")
    weight("qw2", w2)
    nodes.append(helper.make_node("MatMul", ["x3d", "qw2"], ["mm2"]))
    qdq("mm2", "mm2d")
    x3 = helper.make_tensor_value_info("x3", TensorProto.FLOAT, [2, 4])
    quant = helper.make_graph(
        nodes, "q", [*floats.input, x3],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
         for o in ("relud", "mmd", "mm2d")], inits,
    )  # fmt: skip
    qmodel = helper.make_model(quant, opset_imports=[helper.make_opsetid("", 21)])
    fmodel = helper.make_model(floats, opset_imports=[helper.make_opsetid("", 21)])
    sites = find_sites(qmodel)
    found = match_float_file(qmodel, sites, fmodel)
    by_source = {s.source: found.get(s.name) for s in sites if s.source}
    assert by_source["relu"] == ("r", "structure")  # its input paired past the folded BN
    assert by_source["mm"] == ("m1", "structure")  # through the region
    assert by_source["neg"] == ("n", "region")  # Neg and Mul(-1)
    assert by_source["mm2"] == ("m2", "weight")  # w2 within one step, w1 not
    assert by_source["x3"] is None  # no float input left to pair by position
    assert by_source["x"] == ("x", "input name")


def _paddle_and_export_pair():
    """(float, quantized) models of one squeeze-excite block and a head, spelled as Paddle2ONNX
    writes PP-OCR's classifier (float) and as quantbridge exports it after ``import_onnx``
    (quantized, its values named apart from the float file's so that only structure pairs):

    float:      GlobalAveragePool; Conv + Add(Reshape(bias)); HardSigmoid; Mul;
                Add(3) -> Clip(0, 6); Reshape(Concat(Slice(Shape)), -1); MatMul + Add(bias)
    quantized:  ReduceMean; Conv with bias; Mul(0.2) -> Add(0.5) -> Clip(0, 1); Mul;
                Add(3) read by a QuantizeLinear of range [0, 6] (ONNX Runtime drops the Clip);
                Reshape(constant shape); Gemm with bias
    """
    rng = np.random.default_rng(1)
    w = rng.uniform(-1, 1, (2, 2, 1, 1)).astype(np.float32)
    b = np.array([0.3, -0.2], np.float32)
    wf, bf = rng.uniform(-0.5, 0.5, (32, 3)).astype(np.float32), np.float32([0.1, 0, -0.1])
    f32 = np.float32
    floats = helper.make_graph(
        [
            helper.make_node("GlobalAveragePool", ["x"], ["g"]),
            helper.make_node("Conv", ["g", "w"], ["c"]),
            helper.make_node("Reshape", ["b", "bshape"], ["rb"]),
            helper.make_node("Add", ["c", "rb"], ["cb"]),
            helper.make_node("HardSigmoid", ["cb"], ["hs"], alpha=0.2, beta=0.5),
            helper.make_node("Mul", ["x", "hs"], ["y"]),
            helper.make_node("Add", ["y", "three"], ["a3"]),
            helper.make_node("Clip", ["a3", "zero", "six"], ["clip"]),
            helper.make_node("Shape", ["clip"], ["sh"]),
            helper.make_node("Slice", ["sh", "i0", "i1"], ["n"]),
            helper.make_node("Concat", ["n", "minus1"], ["shp"], axis=0),
            helper.make_node("Reshape", ["clip", "shp"], ["flat"]),
            helper.make_node("MatMul", ["flat", "wf"], ["mm"]),
            helper.make_node("Add", ["mm", "bf"], ["logits"]),
        ],
        "f",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3])],
        [_init("w", w), _init("b", b), _init("bshape", np.int64([1, 2, 1, 1])),
         _init("three", f32(3)), _init("zero", f32(0)), _init("six", f32(6)),
         _init("i0", np.int64([0])), _init("i1", np.int64([1])),
         _init("minus1", np.int64([-1])), _init("wf", wf), _init("bf", bf)],
    )  # fmt: skip
    s = 0.02  # activations within +-2.5 and weights within +-127 s
    nodes = []
    inits = [_init("s", f32(s)), _init("z", np.int8(0)), _init("s6", f32(6 / 255)),
             _init("z6", np.uint8(0)), _init("axes", np.int64([2, 3])), _init("k02", f32(0.2)),
             _init("k05", f32(0.5)), _init("k0", f32(0)), _init("k1", f32(1)),
             _init("k3", f32(3)), _init("qb", b), _init("flat_shape", np.int64([1, -1])),
             _init("qbf", bf), _init("s_out", f32(0.1))]  # fmt: skip

    def qdq(t, out, scale="s", zero="z"):
        nodes.append(helper.make_node("QuantizeLinear", [t, scale, zero], [out + "_q"]))
        nodes.append(helper.make_node("DequantizeLinear", [out + "_q", scale, zero], [out]))

    def weight(name, value):
        inits.append(_init(name + "_q", np.round(value / s).astype(np.int8)))
        nodes.append(helper.make_node("DequantizeLinear", [name + "_q", "s", "z"], [name]))

    qdq("x", "v0")
    nodes.append(helper.make_node("ReduceMean", ["v0", "axes"], ["mean"], keepdims=1))
    qdq("mean", "v1")
    weight("qw", w)
    nodes.append(helper.make_node("Conv", ["v1", "qw", "qb"], ["conv"]))
    qdq("conv", "v2")
    nodes.append(helper.make_node("Mul", ["v2", "k02"], ["mul02"]))
    qdq("mul02", "v3")
    nodes += [helper.make_node("Add", ["v3", "k05"], ["add05"]),
              helper.make_node("Clip", ["add05", "k0", "k1"], ["clamp"])]  # fmt: skip
    qdq("clamp", "v4")
    nodes.append(helper.make_node("Mul", ["v0", "v4"], ["mul"]))
    qdq("mul", "v5")
    nodes.append(helper.make_node("Add", ["v5", "k3"], ["add3"]))
    qdq("add3", "v6", "s6", "z6")
    nodes.append(helper.make_node("Reshape", ["v6", "flat_shape"], ["view"]))
    qdq("view", "v7", "s6", "z6")
    weight("qwf", wf)
    nodes.append(helper.make_node("Gemm", ["v7", "qwf", "qbf"], ["gemm"]))
    qdq("gemm", "v8", "s_out")  # logits of about 5
    quant = helper.make_graph(
        nodes, "q", floats.input, [helper.make_tensor_value_info("v8", TensorProto.FLOAT, [1, 3])],
        inits,
    )  # fmt: skip
    opset = [helper.make_opsetid("", 21)]
    fmodel = helper.make_model(floats, opset_imports=opset)
    return fmodel, helper.make_model(quant, opset_imports=opset)


def test_pairs_past_ops_spelled_differently():
    """Regression (PP-OCR's classifier: 8 of 151 sites paired, pairing stopped at the first
    GlobalAveragePool): each quantized value pairs with the float value it approximates, across
    ops the two files spell differently (``region``), past the bias Add a Conv or Gemm holds and
    the Clip a QuantizeLinear's range computes; the Mul(0.2) inside the hard-sigmoid has no float
    counterpart and stays unpaired."""
    fmodel, qmodel = _paddle_and_export_pair()
    onnx.checker.check_model(fmodel, full_check=True)
    onnx.checker.check_model(qmodel, full_check=True)
    sites = find_sites(qmodel)
    found = match_float_file(qmodel, sites, fmodel)
    by_source = {s.source: found.get(s.name) for s in sites if s.source}
    assert by_source == {
        "x": ("x", "input name"),
        "mean": ("g", "region"),  # ReduceMean over H, W == GlobalAveragePool
        "conv": ("cb", "structure + bias Add folded"),
        "mul02": None,
        "clamp": ("hs", "region"),  # Mul(0.2) -> Add(0.5) -> Clip(0, 1) == HardSigmoid
        "mul": ("y", "structure"),
        "add3": ("clip", "structure + Clip absorbed"),
        "view": ("flat", "structure"),  # the float shape is computed from Shape: a constant
        "gemm": ("logits", "structure + bias Add folded"),  # Gemm == MatMul + Add
    }
    # the pairs hold the same values up to quantization noise: every site's SQNR against its
    # float tensor above 20 dB (measured 28-47 dB: int8 steps of 0.02 on values of about 1)
    x = np.random.default_rng(2).uniform(-1, 1, (1, 2, 4, 4)).astype(np.float32)
    r = qb.compare(fmodel, qmodel, inputs={"x": x})
    pairs = {p["float_tensor"]: p["sqnr_db"] for t in r.tensors for p in t["pairs"]}
    assert set(pairs) == {v[0] for v in by_source.values() if v}
    assert min(pairs.values()) > 20, pairs


def test_per_channel_site_is_read_dequantized():
    """Regression (NNCF's per-channel activation quantizers, ModelOpt's Q(weight) -> DQ with
    axis 0): a site with one step per channel was read as its integer codes and measured against
    the float tensor at ~0 dB; it is read as its DequantizeLinear's real values."""
    scales = np.float32([0.01, 0.02])
    floats = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"])], "f",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 3])],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 2, 3, 3])],
    )  # fmt: skip
    quant = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]),
         helper.make_node("QuantizeLinear", ["r", "s", "z"], ["r_q"], axis=1),
         helper.make_node("DequantizeLinear", ["r_q", "s", "z"], ["r_dq"], axis=1)],
        "q", floats.input, [helper.make_tensor_value_info("r_dq", TensorProto.FLOAT, [1, 2, 3, 3])],
        [_init("s", scales), _init("z", np.zeros(2, np.uint8))],
    )  # fmt: skip
    opset = [helper.make_opsetid("", 21)]
    fmodel = helper.make_model(floats, opset_imports=opset)
    qmodel = helper.make_model(quant, opset_imports=opset)
    x = np.random.default_rng(3).uniform(-1, 1, (1, 2, 3, 3)).astype(np.float32)
    r = qb.compare(fmodel, qmodel, inputs={"x": x})
    (pair,) = [p for t in r.tensors for p in t["pairs"] if p.get("float_tensor") == "r"]
    # rounding moves each value by at most half its channel's step: error <= 0.01 on values of
    # about 0.5, SQNR above 30 dB (the codes, up to 100 times the values, gave about -37 dB)
    assert pair["max_abs"] <= 0.01 + 1e-6
    assert pair["sqnr_db"] > 30
