"""Sub-8-bit, narrow-range and 16-bit schemes export to forms ONNX Runtime runs, and agree."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, numpy_helper

import quantbridge as qb
from quantbridge.zoo import resnet18_style

A4 = qb.TensorRecipe(qb.QScheme(4, signed=False, symmetric=False))
A8_NARROW = qb.TensorRecipe(qb.QScheme(8, signed=True, symmetric=True, narrow_range=True))
A16 = qb.TensorRecipe(qb.QScheme(16, signed=True, symmetric=True))
W4 = qb.TensorRecipe(qb.QScheme(4, True, True, True, qb.PerChannel(0)))


@pytest.fixture(scope="module")
def model():
    return resnet18_style(num_classes=100, width=8)


def _run(qm, path, x):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y_ort = sess.run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        y = qm(x).numpy()
    return np.abs(y_ort - y) / qm.output_quantizer().scale.item()


def _init_types(m: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(TensorProto.DataType.Name(i.data_type) for i in m.graph.initializer)


def test_4bit_weights_are_int4_initializers_at_opset_21(model, tmp_path):
    qm = qb.quantize(model, [torch.randn(8, 3, 32, 32)], recipe="w4a8")
    m = qb.export(qm, tmp_path / "w4.onnx", torch.randn(2, 3, 32, 32), opset=21)
    assert _init_types(m)["INT4"] >= 21 and _init_types(m)["INT8"] == 0
    for init in m.graph.initializer:
        if init.data_type == TensorProto.INT4 and init.name.endswith("export_qweight"):
            codes = numpy_helper.to_array(init)
            assert codes.min() >= -7 and codes.max() <= 7  # narrow symmetric 4-bit
    err = _run(qm, tmp_path / "w4.onnx", torch.randn(16, 3, 32, 32))
    assert (err <= 1.001).mean() >= 0.999 and err.max() <= 2.001


def test_4bit_weights_below_opset_21_stay_in_int8_containers(model, tmp_path):
    qm = qb.quantize(model, [torch.randn(8, 3, 32, 32)], recipe="w4a8")
    m = qb.export(qm, tmp_path / "w4.onnx", torch.randn(2, 3, 32, 32), opset=18)
    assert _init_types(m)["INT4"] == 0
    for init in m.graph.initializer:
        if init.name.endswith("export_qweight"):
            codes = numpy_helper.to_array(init)
            assert codes.dtype == np.int8 and codes.min() >= -7 and codes.max() <= 7


@pytest.mark.parametrize(
    "activations, bounds",
    # int8 narrow after a ReLU: uint8 [0, 127], same codes (onnx/exporter/_relu_quant)
    [(A4, {(0, 15)}), (A8_NARROW, {(-127, 127), (0, 127)})],
    ids=["uint4-activations", "int8-narrow-activations"],
)
def test_narrow_activations_export_as_q_clip_dq(model, tmp_path, activations, bounds):
    qm = qb.quantize(model, [torch.randn(8, 3, 32, 32)], recipe=qb.Recipe(activations=activations))
    m = qb.export(qm, tmp_path / "a.onnx", torch.randn(2, 3, 32, 32))
    producers = {o: n for n in m.graph.node for o in n.output}
    consts = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    for n in m.graph.node:
        if n.op_type == "Constant":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    clips = [n for n in m.graph.node if n.op_type == "Clip"]
    assert clips, "no integer Clip between QuantizeLinear and DequantizeLinear"
    for clip in clips:
        assert producers[clip.input[0]].op_type == "QuantizeLinear"
        assert (int(consts[clip.input[1]]), int(consts[clip.input[2]])) in bounds
    err = _run(qm, tmp_path / "a.onnx", torch.randn(16, 3, 32, 32))
    assert (err <= 1.001).mean() >= 0.999 and err.max() <= 2.001


def test_16bit_activations_need_opset_21_and_run(model, tmp_path):
    qm = qb.quantize(model, [torch.randn(8, 3, 32, 32)], recipe=qb.Recipe(activations=A16))
    with pytest.raises(ValueError, match="16-bit quantization needs opset >= 21"):
        qb.export(qm, tmp_path / "a16.onnx", torch.randn(2, 3, 32, 32), opset=18)
    m = qb.export(qm, tmp_path / "a16.onnx", torch.randn(2, 3, 32, 32))
    assert {o.domain: o.version for o in m.opset_import}[""] == 21
    assert _init_types(m)["INT16"] >= 1
    err = _run(qm, tmp_path / "a16.onnx", torch.randn(16, 3, 32, 32))
    # ORT has no int16 conv kernel: it computes in float32 like torch, but in another summation
    # order; one 16-bit step is ~1.5e-5 of the range, the size of float32 accumulation noise over
    # a 3x3x64 dot product, so a few percent of outputs sit one code away.
    assert (err <= 1.001).mean() >= 0.95 and err.max() <= 2.001
