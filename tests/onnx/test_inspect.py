"""``inspect_model`` on real exports (quantbridge QDQ, plain float, ONNX Runtime QOperator), on
hand-built graphs for each int8/float rule of ``quantbridge.onnx.inspector``, and against the
real engine: what the report calls an int8 Conv/Gemm is what ONNX Runtime turns into
QLinearConv/QGemm."""

from __future__ import annotations

import collections
import json
import os
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static
from torch import nn

import quantbridge as qb
from quantbridge.onnx import inspect_model
from quantbridge.onnx.inspector import bits_for_range
from quantbridge.torch._fakequant import BiasQuantizer, Quantizer
from quantbridge.zoo import BasicBlock, DigitsCNN, resnet18_style


def _resnet():
    return resnet18_style(num_classes=10, width=8)


@pytest.fixture(scope="module")
def qdq_resnet(tmp_path_factory):
    """(path, qmodel, torch model) for the QDQ export of resnet18_style(10, width=8)."""
    model = _resnet()
    batches = [torch.randn(2, 3, 32, 32) for _ in range(2)]
    qmodel = qb.quantize(model, batches, progress=False, recipe="int8")
    path = tmp_path_factory.mktemp("qdq") / "resnet.int8.onnx"
    qb.export(qmodel, path, example_inputs=batches[0])
    return path, qmodel, model


@pytest.fixture(scope="module")
def float_digits(tmp_path_factory):
    """A float DigitsCNN exported by plain torch.onnx.export (weights in a .data file)."""
    path = tmp_path_factory.mktemp("float") / "digits.onnx"
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            DigitsCNN().eval(),
            (torch.rand(2, 1, 8, 8),),
            path,
            dynamo=True,
            dynamic_shapes=({0: torch.export.Dim("batch")},),
            external_data=True,
            verbose=False,
        )
    return path


class _Reader(CalibrationDataReader):
    def __init__(self):
        rng = np.random.default_rng(0)
        self._it = iter([{"x": rng.random((8, 1, 8, 8), np.float32)} for _ in range(2)])

    def get_next(self):
        return next(self._it, None)


@pytest.fixture(scope="module")
def qoperator_digits(float_digits):
    """ONNX Runtime's own static quantization of the float file, in QOperator form."""
    path = float_digits.with_name("digits.qop.onnx")
    quantize_static(
        str(float_digits),
        str(path),
        _Reader(),
        quant_format=QuantFormat.QOperator,
        per_channel=True,
    )
    return path


def _count_modules(model: nn.Module, kind: type) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


# -- quantbridge's QDQ export ---------------------------------------------------------------------
def test_qdq_export_has_int8_weights_and_int8_convs(qdq_resnet):
    path, _, model = qdq_resnet
    report = inspect_model(path)
    convs, linears = _count_modules(model, nn.Conv2d), _count_modules(model, nn.Linear)
    assert (convs, linears) == (20, 1)
    assert report.form == "QDQ"
    assert report.float_weights == []
    assert "float weights: none" in report.format()
    assert report.int8_ops["Conv"] == convs and "Conv" not in report.float_ops
    assert report.int8_ops["Gemm"] == linears
    assert len(report.weights) == convs + linears
    expected = ("int8", 8, "per-channel(axis=0)", "int32")
    for w in report.weights:
        assert (w.dtype, w.bits, w.granularity, w.bias_dtype) == expected, w


def _quantizer_calls(qmodel) -> collections.Counter:
    """Call sites of quantizer modules in the captured graph: activation, weight, bias."""
    calls = collections.Counter()
    for node in qmodel.graph.nodes:
        if node.op == "call_module":
            module = qmodel.get_submodule(node.target)
            if isinstance(module, BiasQuantizer):
                calls["bias"] += 1
            elif isinstance(module, Quantizer):
                calls[module.kind] += 1
    return calls


def test_qdq_export_op_counts_are_exact(qdq_resnet):
    """Counted from the torch model and the captured graph, not from the ONNX graph: one
    QuantizeLinear per activation-quantizer call (a data-movement op re-applies its input's
    quantizer), one DequantizeLinear per quantizer call."""
    path, qmodel, model = qdq_resnet
    report = inspect_model(path)
    calls = _quantizer_calls(qmodel)
    convs = _count_modules(model, nn.Conv2d)
    expected = {
        "Conv": convs,
        "Gemm": _count_modules(model, nn.Linear),
        "Add": _count_modules(model, BasicBlock),  # one residual add per block
        "QuantizeLinear": calls["activation"],
        "DequantizeLinear": calls["activation"] + calls["weight"] + calls["bias"],
    }
    assert {k: report.op_counts[k] for k in expected} == expected
    assert calls["weight"] == calls["bias"] == convs + 1  # int8 weight + int32 bias per Conv/Gemm
    graph_counts = collections.Counter(n.op_type for n in onnx.load(path).graph.node)
    assert report.op_counts == dict(graph_counts)
    assert report.quantize_nodes == report.qdq_pairs == calls["activation"]
    assert report.activation_quantizers == {"uint8 [0, 255] 8-bit": calls["activation"]}


def test_qdq_export_header(qdq_resnet):
    path, _, _ = qdq_resnet
    report = inspect_model(path)
    assert report.opsets == {"": 18}
    assert report.ir_version == onnx.load(path).ir_version
    assert report.producer.startswith("quantbridge")
    assert [(t.name, t.dtype, t.shape) for t in report.inputs] == [
        ("x", "float", ("batch", 3, 32, 32))
    ]
    assert [(t.dtype, t.shape) for t in report.outputs] == [("float", ("batch", 10))]
    assert report.size_bytes == os.path.getsize(path)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["float_weights"] == [] and d["int8_ops"]["Conv"] == 20


def test_report_of_a_model_proto_equals_report_of_its_file(qdq_resnet):
    path, _, _ = qdq_resnet
    from_file, from_proto = inspect_model(path), inspect_model(onnx.load(path))
    assert from_proto.path is None
    assert from_proto.int8_ops == from_file.int8_ops
    assert from_proto.weights == from_file.weights


def test_int8_convs_are_the_ones_onnx_runtime_fuses(qdq_resnet, tmp_path):
    path, _, _ = qdq_resnet
    fused = _ort_optimized_ops(path, tmp_path)
    report = inspect_model(path)
    assert fused["QLinearConv"] == report.int8_ops["Conv"]
    assert fused["QGemm"] == report.int8_ops["Gemm"]
    assert fused["QLinearAdd"] == report.int8_ops["Add"]


def _ort_optimized_ops(path, tmp_path) -> collections.Counter:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "ort_optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath)
    return collections.Counter(n.op_type for n in optimized.graph.node)


@pytest.mark.parametrize("recipe", ["int8", "int8_symmetric"])
def test_relu_rule_matches_onnx_runtime(recipe, tmp_path):
    """uint8 activations (zero point 0 = qmin): QuantizeLinear absorbs the Relu, Conv is int8.
    int8 symmetric (zero point 0 > qmin): the exporter moves the Relu into a uint8 grid with zero
    point 0 (``onnx/exporter/_relu_quant``), and the Conv is int8 as well."""
    torch.manual_seed(0)
    batches = [torch.rand(8, 1, 8, 8) for _ in range(2)]
    qmodel = qb.quantize(DigitsCNN().eval(), batches, recipe=recipe, progress=False)
    path = tmp_path / "digits.onnx"
    qb.export(qmodel, path, example_inputs=batches[0])
    report = inspect_model(path)
    fused = _ort_optimized_ops(path, tmp_path)
    assert fused["QLinearConv"] == report.int8_ops.get("Conv", 0)
    assert fused["QGemm"] == report.int8_ops.get("Gemm", 0)
    assert report.int8_ops.get("Conv", 0) == 3


# -- a float model --------------------------------------------------------------------------------
def test_float_model_reports_its_float_weights(float_digits):
    report = inspect_model(float_digits)
    assert report.form == "float"
    assert report.int8_ops == {}
    assert report.float_ops["Conv"] == 3 and report.float_ops["Gemm"] == 2
    assert len(report.float_weights) == len(report.weights) == 5
    assert {(w.dtype, w.bits, w.granularity) for w in report.weights} == {("float", 32, "float")}
    assert "fc1.weight" in {w.name for w in report.float_weights}
    assert "float weights: none" not in report.format()
    assert "fc1.weight" in report.format().split("float weights:")[1]
    data = [f for f in os.listdir(float_digits.parent) if f.endswith(".data")]
    assert data, "expected torch to write external data"
    on_disk = os.path.getsize(float_digits) + sum(
        os.path.getsize(float_digits.parent / f) for f in data
    )
    assert report.size_bytes == on_disk


# -- ONNX Runtime's QOperator form ----------------------------------------------------------------
def test_qoperator_model(qoperator_digits):
    report = inspect_model(qoperator_digits)
    assert report.form == "QOperator"
    assert report.int8_ops["QLinearConv"] == 3
    assert report.int8_ops["QGemm"] == 2
    assert report.int8_ops["QLinearAdd"] == 1
    assert report.int8_ops["MaxPool"] == 1  # on uint8 tensors
    assert report.opsets["com.microsoft"] == 1
    assert report.float_weights == []
    assert len(report.weights) == 5
    assert all(w.dtype == "int8" and w.bias_dtype == "int32" for w in report.weights)
    assert all(w.granularity.startswith("per-channel") for w in report.weights)
    assert report.qdq_pairs == 0


# -- the rules, one hand-built graph each ---------------------------------------------------------
def _init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _conv_graph(
    activation=None, zero_point=0, zp_type=np.uint8, float_weight=False, clip=(0, 6), opset=19
):
    """x -> Q -> DQ -> Conv(DQ(w_int8) or w_float) [-> activation] -> Q -> DQ -> y."""
    inits = [
        _init("s", np.float32(0.05)),
        _init("zp", zp_type(zero_point)),
        _init("x_zp", np.uint8(0)),
        _init("ws", np.full(4, 0.01, np.float32)),
        _init("wzp", np.zeros(4, np.int8)),
        _init("clip_lo", np.float32(clip[0])),
        _init("clip_hi", np.float32(clip[1])),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "x_zp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "x_zp"], ["xd"]),
    ]
    if float_weight:
        inits.append(_init("w", np.ones((4, 2, 1, 1), np.float32)))
        weight = "w"
    else:
        inits.append(_init("wq", np.full((4, 2, 1, 1), 3, np.int8)))
        nodes.append(helper.make_node("DequantizeLinear", ["wq", "ws", "wzp"], ["wd"], axis=0))
        weight = "wd"
    nodes.append(helper.make_node("Conv", ["xd", weight], ["c"], name="conv"))
    out = "c"
    if activation == "Relu":
        nodes.append(helper.make_node("Relu", ["c"], ["a"], name="act"))
        out = "a"
    elif activation == "Clip" and opset >= 11:
        nodes.append(helper.make_node("Clip", ["c", "clip_lo", "clip_hi"], ["a"], name="act"))
        out = "a"
    elif activation == "Clip":  # opset 6-10: bounds are attributes
        nodes.append(helper.make_node("Clip", ["c"], ["a"], name="act", min=clip[0], max=clip[1]))
        out = "a"
    nodes += [
        helper.make_node("QuantizeLinear", [out, "s", "zp"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "s", "zp"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _kinds(report) -> tuple[dict, dict]:
    return report.int8_ops, report.float_ops


def test_rule_qdq_conv_is_int8():
    assert _kinds(inspect_model(_conv_graph())) == ({"Conv": 1}, {})


def test_rule_relu_absorbed_when_zero_point_is_qmin():
    assert _kinds(inspect_model(_conv_graph("Relu", 0, np.uint8))) == ({"Conv": 1, "Relu": 1}, {})
    assert _kinds(inspect_model(_conv_graph("Relu", -128, np.int8))) == (
        {"Conv": 1, "Relu": 1},
        {},
    )


def test_rule_relu_not_absorbed_when_zero_point_is_above_qmin():
    report = inspect_model(_conv_graph("Relu", 0, np.int8))
    assert _kinds(report) == ({}, {"Conv": 1, "Relu": 1})
    assert report.float_nodes == ["Conv 'conv'", "Relu 'act'"]


def test_rule_clip_absorbed_when_quantize_range_is_inside():
    # uint8, scale 0.05, zero point 0: representable [0, 12.75]
    assert _kinds(inspect_model(_conv_graph("Clip", clip=(0, 20))))[1] == {}
    assert _kinds(inspect_model(_conv_graph("Clip", clip=(0, 6)))) == ({}, {"Conv": 1, "Clip": 1})


@pytest.mark.parametrize(("clip", "absorbed"), [((0.0, 20.0), True), ((0.0, 6.0), False)])
def test_rule_clip_bounds_as_attributes(clip, absorbed):
    report = inspect_model(_conv_graph("Clip", clip=clip, opset=10))
    assert _kinds(report) == (
        ({"Conv": 1, "Clip": 1}, {}) if absorbed else ({}, {"Conv": 1, "Clip": 1})
    )


def test_rule_float_weight_makes_conv_float_and_is_reported():
    report = inspect_model(_conv_graph(float_weight=True))
    assert _kinds(report) == ({}, {"Conv": 1})
    assert [(w.name, w.dtype, w.bits, w.granularity) for w in report.float_weights] == [
        ("w", "float", 32, "float")
    ]


def test_rule_activation_matmul_has_no_weight():
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in "ab"],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 2])],
    )
    report = inspect_model(helper.make_model(graph))
    assert report.weights == [] and report.float_ops == {"MatMul": 1}


def test_bits_from_clip_between_quantize_and_dequantize(tmp_path):
    """4-bit activations are uint8 + Clip(0, 15); 4-bit weights are int8 values in [-7, 7]."""
    recipe = qb.Recipe(
        weights=qb.TensorRecipe(qb.QScheme(4, True, True, True, qb.PerChannel(0))),
        activations=qb.TensorRecipe(qb.QScheme(4, False, False, False, qb.PerTensor())),
    )
    batches = [torch.rand(8, 1, 8, 8) for _ in range(2)]
    qmodel = qb.quantize(DigitsCNN().eval(), batches, recipe=recipe, progress=False)
    exported = qb.export(qmodel, tmp_path / "w4a4.onnx", example_inputs=batches[0], opset=18)
    report = inspect_model(exported)  # opset 18: 4-bit weights in int8 containers
    assert report.activation_quantizers == {"uint8 [0, 15] 4-bit": report.qdq_pairs}
    assert report.qdq_pairs == report.quantize_nodes > 0
    assert {(w.dtype, w.bits) for w in report.weights} == {("int8", 4)}


@pytest.mark.parametrize(
    ("lo", "hi", "bits"),
    [(0, 1, 1), (0, 15, 4), (0, 16, 5), (0, 255, 8), (-7, 7, 4), (-8, 7, 4), (-8, 8, 5),
     (-127, 127, 8), (-128, 127, 8), (-129, 0, 9), (-32768, 32767, 16)],
)  # fmt: skip
def test_bits_for_range(lo, hi, bits):
    assert bits_for_range(lo, hi) == bits


# -- errors ---------------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        inspect_model(tmp_path / "nope.onnx")


@pytest.mark.parametrize("content", [b"", b"hello, not a model\n", bytes(range(256)) * 4])
def test_not_an_onnx_file(tmp_path, content):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="not an ONNX model"):
        inspect_model(path)


def test_missing_external_data(tmp_path):
    path = tmp_path / "external.onnx"
    onnx.save_model(
        _conv_graph(float_weight=True),
        path,
        save_as_external_data=True,
        location="w.data",
        size_threshold=0,
    )
    (tmp_path / "w.data").unlink()
    with pytest.raises(ValueError, match="cannot read its external data"):
        inspect_model(path)


def test_directory_and_wrong_type(tmp_path):
    with pytest.raises(IsADirectoryError):
        inspect_model(tmp_path)
    with pytest.raises(TypeError, match="path or an onnx.ModelProto"):
        inspect_model(42)


@pytest.mark.parametrize("top, note", [(63, True), (127, False)])
def test_seven_bit_weights_are_explained(top, note):
    # a newcomer reading "int8 7-bit" (the default recipe's weights) asked why 7: the report
    # says, and only for 7-bit int8 weights
    model = _conv_graph()
    (w,) = [i for i in model.graph.initializer if i.name == "wq"]
    codes = np.full((4, 2, 1, 1), 3, np.int8)
    codes[0, 0, 0, 0], codes[1, 0, 0, 0] = top, -top  # [-63, 63]: 7 bits; [-127, 127]: 8
    w.CopyFrom(numpy_helper.from_array(codes, "wq"))
    text = inspect_model(model).format()
    assert ("int8 7-bit" in text) is note
    assert (
        "7-bit: int8 weights with values within [-64, 63], exact in ONNX Runtime" in text
    ) is note
