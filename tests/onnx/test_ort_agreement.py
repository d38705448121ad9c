"""Exported QDQ models run in a real ONNX Runtime CPU session and agree with ``qmodel(x)``.

Criterion (issue #2): at least 99.9% of output elements within 1 LSB of the output scale, the
rest within 2 LSB. Why the engine may differ at all: ONNX Runtime fuses DQ -> Conv/Gemm/MatMul/Add
-> Q into integer kernels (QLinearConv, QGemm, QLinearAdd) that accumulate in int32 and requantize
with a float multiplier, while torch computes the same sums in float32 before one division by the
output scale. The two agree exactly except where a value lands within float32 rounding of a
rounding tie (x.5 LSB); such a one-code flip in an inner layer can propagate, which is why the
criterion is stated on the outputs and allows a rare 2 LSB.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import quantbridge as qb
from quantbridge.zoo import TinyTransformer, TwoInputConcat, mobilenetv2_style, resnet18_style


def _ort_outputs(path, feeds: dict) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: feeds[n] for n in names})[0]


def _lsb_error(qm, y_ort: np.ndarray, y_torch: torch.Tensor) -> np.ndarray:
    out_q = qm.output_quantizer()
    return np.abs(y_ort - y_torch.numpy()) / out_q.scale.item()


def _assert_agrees(err: np.ndarray, min_elements: int) -> None:
    assert err.size >= min_elements
    within1 = float((err <= 1.0 + 1e-3).mean())  # 1e-3 LSB: float32 rounding of the difference
    assert within1 >= 0.999, f"only {within1:.4%} of outputs within 1 LSB (max {err.max():.2f})"
    assert err.max() <= 2.0 + 1e-3, f"max error {err.max():.2f} LSB"


def _ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)


def test_resnet18_style(tmp_path):
    m = resnet18_style(num_classes=100, width=16)
    qm = qb.quantize(m, [torch.randn(8, 3, 32, 32) for _ in range(4)], recipe="native")
    x = torch.randn(32, 3, 32, 32)
    with torch.no_grad():
        y = qm(x)
    model = qb.export(qm, tmp_path / "r18.onnx", x[:2])
    assert qb.onnx.float_weights(model) == []
    assert _ops(model)["Conv"] == 20 and _ops(model)["Add"] == 8
    _assert_agrees(_lsb_error(qm, _ort_outputs(tmp_path / "r18.onnx", {"x": x.numpy()}), y), 3200)


def test_mobilenetv2_style(tmp_path):
    m = mobilenetv2_style(num_classes=100, width=0.35)
    qm = qb.quantize(m, [torch.randn(8, 3, 32, 32) for _ in range(4)], recipe="native")
    x = torch.randn(32, 3, 32, 32)
    with torch.no_grad():
        y = qm(x)
    model = qb.export(qm, tmp_path / "mbv2.onnx", x[:2])
    assert qb.onnx.float_weights(model) == []
    groups = [
        a.i
        for n in model.graph.node
        if n.op_type == "Conv"
        for a in n.attribute
        if a.name == "group"
    ]
    assert any(g > 1 for g in groups)  # depthwise convolutions are in the graph
    _assert_agrees(_lsb_error(qm, _ort_outputs(tmp_path / "mbv2.onnx", {"x": x.numpy()}), y), 3200)


def test_tiny_transformer(tmp_path):
    m = TinyTransformer(num_classes=64)
    qm = qb.quantize(m, [torch.randint(0, 100, (8, 16)) for _ in range(4)], recipe="native")
    x = torch.randint(0, 100, (64, 16))
    with torch.no_grad():
        y = qm(x)
    model = qb.export(qm, tmp_path / "tt.onnx", x[:2])
    ops = _ops(model)
    assert ops["MatMul"] >= 4 and ops["LayerNormalization"] == 4 and ops["Softmax"] == 2
    assert qb.onnx.float_weights(model) == []
    err = _lsb_error(qm, _ort_outputs(tmp_path / "tt.onnx", {"tokens": x.numpy()}), y)
    _assert_agrees(err, 4096)


def test_two_inputs_and_keyword_input(tmp_path):
    def batch(n):
        return {
            "image": torch.randn(n, 3, 8, 8),
            "extra": torch.randn(n, 6),
            "scale": torch.rand(n, 1) + 0.5,
        }

    qm = qb.quantize(TwoInputConcat(), [batch(8) for _ in range(4)], recipe="native")
    x = batch(512)
    with torch.no_grad():
        y = qm(**x)
    model = qb.export(qm, tmp_path / "two.onnx", batch(2))
    assert [i.name for i in model.graph.input] == ["image", "extra", "scale"]
    assert _ops(model)["Concat"] == 1
    feeds = {k: v.numpy() for k, v in x.items()}
    _assert_agrees(_lsb_error(qm, _ort_outputs(tmp_path / "two.onnx", feeds), y), 2048)


def test_dynamic_batch_dimension(tmp_path):
    qm = qb.quantize(
        resnet18_style(num_classes=10, width=8), [torch.randn(4, 3, 32, 32)], recipe="int8"
    )
    model = qb.export(qm, tmp_path / "m.onnx", torch.randn(1, 3, 32, 32))
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert dim.dim_param == "batch"
    for n in (1, 3, 7):
        x = torch.randn(n, 3, 32, 32)
        assert _ort_outputs(tmp_path / "m.onnx", {"x": x.numpy()}).shape == (n, 10)


@pytest.mark.parametrize("opset", [13, 17, 21])
def test_opset_override(tmp_path, opset):
    qm = qb.quantize(
        resnet18_style(num_classes=10, width=8), [torch.randn(4, 3, 32, 32)], recipe="int8"
    )
    model = qb.export(qm, tmp_path / "m.onnx", torch.randn(2, 3, 32, 32), opset=opset)
    assert {o.domain: o.version for o in model.opset_import}[""] == opset
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        y = qm(x)
    err = _lsb_error(qm, _ort_outputs(tmp_path / "m.onnx", {"x": x.numpy()}), y)
    assert err.max() <= 2.0 + 1e-3


def test_slow_forms_warn_and_default_does_not(tmp_path):
    import warnings

    m = resnet18_style(num_classes=10, width=8)
    data = [torch.randn(4, 3, 32, 32)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", qb.onnx.PerformanceWarning)
        qb.export(qb.quantize(m, data, recipe="int8"), tmp_path / "fast.onnx", data[0])
    uint8_weights = qb.Recipe(
        weights=qb.TensorRecipe(qb.QScheme(8, False, False, False, qb.PerChannel(0)))
    )
    with pytest.warns(qb.onnx.PerformanceWarning, match="uint8 weights"):
        qb.export(qb.quantize(m, data, recipe=uint8_weights), tmp_path / "slow.onnx", data[0])
    with warnings.catch_warnings():  # int8 symmetric activations are now exported in fused form
        warnings.simplefilter("error", qb.onnx.PerformanceWarning)
        qb.export(qb.quantize(m, data, recipe="int8_symmetric"), tmp_path / "sym.onnx", data[0])


def test_exported_file_carries_no_debug_metadata(tmp_path):
    qm = qb.quantize(
        resnet18_style(num_classes=10, width=8), [torch.randn(4, 3, 32, 32)], recipe="int8"
    )
    model = qb.export(qm, tmp_path / "m.onnx", torch.randn(2, 3, 32, 32))
    assert all(len(n.metadata_props) == 0 for n in model.graph.node)
    assert len(model.graph.value_info) == 0
    props = {p.key for p in model.metadata_props}
    assert {"quantbridge.recipe", "quantbridge.quantizers"} <= props
