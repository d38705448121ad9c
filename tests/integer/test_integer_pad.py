"""``Pad`` lowers to the integer program (``lowering._movement._pad``, kernel ``pad``): a zero or
reflect padding of a quantized tensor moves its codes, as ``qb.export`` writes it (``Q -> Pad(codes,
zero point) -> DQ``, ``onnx/exporter/_pad_codes``). Before, every model with an ``nn.ZeroPad2d``
was refused ("no integer lowering: Pad"). The program must equal ONNX Runtime on the exported file
(the same integer convolutions and float requantization: at most 1 LSB by design, measured 0), and
its three emitters (numpy, C, integer ONNX) must agree bit for bit."""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.recipe import native_preset


class _PadConv(nn.Module):
    def __init__(self, pad: nn.Module):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.c1, self.pad, self.c2 = nn.Conv2d(3, 8, 3), pad, nn.Conv2d(8, 4, 3)
        with torch.no_grad():
            for m in (self.c1, self.c2):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.3)
        self.eval()

    def forward(self, x):
        return self.c2(self.pad(torch.relu(self.c1(x))))


@pytest.mark.parametrize(
    "pad", [nn.ZeroPad2d((1, 2, 1, 0)), nn.ReflectionPad2d(1)], ids=["zero", "reflect"]
)
def test_pad_lowers_and_the_emitters_agree(pad, tmp_path, three_emitters):
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(4, 3, 10, 10, generator=g) for _ in range(3)]
    # ONNX Runtime computes the file exactly only with weights its kernels cannot saturate here
    # (int8_avx2 on a CPU without VNNI: tests/onnx/test_saturation.py)
    q = qb.quantize(_PadConv(pad), calib, recipe=native_preset(), progress=False)
    x = torch.randn(4, 3, 10, 10, generator=g)
    path = tmp_path / "pad.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qb.export(q, path, example_inputs=x)
    prog = qb.lower(path)
    assert "pad" in {s.op for s in prog.steps}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"x": x.numpy()})
    (got,) = prog.run({"x": x.numpy()}).values()
    step = prog.outputs[0].tensor.scale
    assert np.abs(got - expected).max() <= step * 1.0001
    three_emitters(prog, {"x": x.numpy()}, tmp_path)


def _float_pad_graph(qdq_graph, source: str):
    """``Pad -> [Clip] -> QuantizeLinear`` of a float value: the graph input itself (HF
    EfficientNet's ZeroPad2d before its first quantizer) or a LayerNorm output padded to whole
    windows (HF Swin). Before, both were refused ("the padded tensor must be integer codes")."""
    g = qdq_graph((2, 3, 5, 6), scale=0.05, zero=120)
    if source == "input":
        g.nodes, g.inits = [], []
    pads = g.const(np.array([0, 0, 1, 0, 0, 0, 2, 1], np.int64))
    if source == "input":
        padded = g.node("Pad", ["x", pads])
        return g, g.quant(padded, 0.04, 128)
    gamma = g.const(g.rng.uniform(0.5, 1.5, 6).astype(np.float32))
    beta = g.const(g.rng.normal(0, 0.3, 6).astype(np.float32))
    ln = g.node("LayerNormalization", [g.x, gamma, beta], axis=-1)
    padded = g.node("Pad", [ln, pads, g.const(np.float32(0))])
    # a Clip with a minimum above 0 turns the padded zeros into the code of 0.1, not the zero point
    clipped = g.node("Clip", [padded, g.const(np.float32(0.1)), g.const(np.float32(6))])
    return g, g.quant(clipped, 0.02, 10)


@pytest.mark.parametrize("source", ["input", "layernorm"])
def test_pad_of_a_float_value_is_quantized_then_padded(source, qdq_graph, layerwise, tmp_path,
                                                       three_emitters):  # fmt: skip
    """Quantization is elementwise and ``quantize(0)`` is the zero point, so padding the codes
    gives ONNX Runtime's ``quantize(pad(x))``: the input pad must be exact (the same float
    QuantizeLinear in both); the LayerNorm's integer kernel is within 1 LSB of the float one
    (``kernels._normalize``), and the padded positions are exact (a constant code)."""
    g, y = _float_pad_graph(qdq_graph, source)
    model = g.model(y)
    x = np.random.default_rng(1).normal(0, 2, (2, 3, 5, 6)).astype(np.float32)
    prog = qb.lower(model, input_shapes={"x": x.shape})
    assert "pad" in {s.op for s in prog.steps}
    diffs = layerwise(model, prog, {"x": x})
    assert max(int(d.max()) for d in diffs.values()) <= (0 if source == "input" else 1)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"x": x})
    (got,) = prog.run({"x": x}).values()
    step = prog.outputs[0].tensor.scale
    assert got.shape == (2, 3, 8, 7) and np.abs(got - expected).max() <= step * 1.0001
    assert np.array_equal(got[:, :, 0], expected[:, :, 0])  # a padded row: exact
    three_emitters(prog, {"x": x}, tmp_path)
