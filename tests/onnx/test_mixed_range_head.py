"""Mixed-range detector heads through ``quantize_onnx``, measured in ONNX Runtime (node by node
and with its fused int8 kernels): the small-range part keeps its precision.

* a Concat joining box coordinates in pixels and probabilities (the graph output): the inputs
  keep their own scales and the concat stays float (``quantbridge.torch._ranges``);
* one conv writing both kinds of channels straight to the graph output: the conv joins the float
  head (``onnx.quantizer._outputs``).

SQNR of a part = 10 log10(sum ref^2 / sum (ref - int8)^2) against the float file in ORT.
``native`` weights (7-bit on this AVX2-without-VNNI CPU) so the fused session computes what the
file says (see COMMON facts: ORT's u8 x s8 kernels saturate here with full-range weights).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from test_quantize_onnx import _detector_head, _images

import quantbridge as qb
from quantbridge.onnx.quantizer._outputs import mixed_range_outputs


def _run(model: onnx.ModelProto, x: np.ndarray, optimize: bool) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), so, providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"x": x})[0]


def _sqnr(reference: np.ndarray, got: np.ndarray) -> float:
    r = reference.astype(np.float64)
    noise = ((r - got) ** 2).sum()
    return float("inf") if noise == 0 else float(10 * np.log10((r**2).sum() / noise))


def test_concat_head_probabilities_survive_in_ort(monkeypatch):
    """Measured (native): probabilities 42.1 dB, boxes 36.0 dB, fused and node by node alike;
    one shared scale (range check off): probabilities 0.0 dB (every one rounds to 0), boxes
    unchanged. Bars: 6 dB under the measured levels (one bit), and the control at most 3 dB."""
    src = _detector_head()
    calib, x = {"x": _images(0, 16, 8, 8)}, _images(1, 8, 8, 8)
    y_float = _run(src, x, True)
    out = qb.quantize_onnx(src, calib, None, recipe="native", progress=False)
    for optimize in (False, True):
        y = _run(out, x, optimize)
        assert _sqnr(y_float[:, 4:], y[:, 4:]) >= 36.0, optimize
        assert _sqnr(y_float[:, :4], y[:, :4]) >= 30.0, optimize
    (line,) = qb.onnx.inspect_model(out).concats
    assert line.endswith("output float")

    from quantbridge.torch import _quantize

    monkeypatch.setattr(_quantize, "mismatched_concats", lambda *a, **k: {})
    shared = qb.quantize_onnx(src, calib, None, recipe="native", progress=False)
    assert _sqnr(y_float[:, 4:], _run(shared, x, True)[:, 4:]) <= 3.0


def _one_conv_head(gain: float) -> onnx.ModelProto:
    """``x -> Conv -> Relu -> Conv`` (the graph output): output channels 0-3 ``gain`` times
    larger than channels 4-7 (pixels and scores from one head conv)."""
    rng = np.random.default_rng(0)
    w0 = (rng.standard_normal((8, 3, 3, 3)) * 0.5).astype(np.float32)
    w1 = (rng.standard_normal((8, 8, 1, 1)) * 0.5).astype(np.float32)
    w1[:4] *= gain
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["f"], name="stem", pads=[1] * 4),
        helper.make_node("Relu", ["f"], ["fr"], name="stem_relu"),
        helper.make_node("Conv", ["fr", "w1"], ["out"], name="head_conv"),
    ]
    graph = helper.make_graph(
        nodes,
        "det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 8, 8, 8])],
        [numpy_helper.from_array(w0, "w0"), numpy_helper.from_array(w1, "w1")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_mixed_range_graph_output_layer_stays_float():
    """Measured (native): small channels 39.2 dB with the head conv float (its input still
    int8), fused and node by node; 0.0 dB with it quantized (``float_head=False``: one output
    scale set by the x300 channels; large channels 34.8 dB). A model whose channels are alike
    (gain 1, ratio 1.6) keeps every conv int8. Bars: 6 dB (one bit) under, control <= 3 dB."""
    calib, x = {"x": _images(0, 16, 8, 8)}, _images(1, 8, 8, 8)
    src = _one_conv_head(300.0)
    y_float = _run(src, x, True)
    out = qb.quantize_onnx(src, calib, None, recipe="native", progress=False)
    report = qb.onnx.inspect_model(out)
    assert report.float_ops == {"Conv": 1}, report.float_ops
    for optimize in (False, True):
        y = _run(out, x, optimize)
        assert _sqnr(y_float[:, 4:], y[:, 4:]) >= 33.0, optimize
    quantized = qb.quantize_onnx(src, calib, None, "native", progress=False, float_head=False)
    assert _sqnr(y_float[:, 4:], _run(quantized, x, True)[:, 4:]) <= 3.0

    alike = qb.quantize_onnx(_one_conv_head(1.0), calib, None, "native", progress=False)
    assert qb.onnx.inspect_model(alike).float_ops.get("Conv", 0) == 0


def test_mixed_range_outputs_names_the_writer():
    import torch

    model = _one_conv_head(300.0)
    value = torch.ones(2, 8, 4, 4)
    value[:, :4] *= 300.0
    assert mixed_range_outputs(model, [value]) == {"head_conv": 300.0}
    assert mixed_range_outputs(model, [torch.ones(2, 8, 4, 4)]) == {}
