"""A conv whose weight is a registered buffer (timm TResNet's anti-aliasing blur,
``F.conv2d(x, self.filt, groups=C)``): quantize crashed in freeze with torch's
"AttributeError: `filt` is not an nn.Parameter" (the weight quantizer read it by get_parameter)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import quantbridge as qb


class _Blur(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("filt", torch.arange(36.0).reshape(4, 1, 3, 3) / 100)

    def forward(self, x):
        return F.conv2d(F.pad(self.conv(x), (1, 1, 1, 1), "reflect"), self.filt, stride=2, groups=4)


def test_a_buffer_weight_is_quantized_and_exported(tmp_path):
    torch.manual_seed(0)
    model = _Blur().eval()
    data = [torch.randn(1, 3, 16, 16) for _ in range(2)]
    qm = qb.quantize(model, data)
    path = tmp_path / "blur.onnx"
    qb.export(qm, path, data[0])
    m = onnx.load(str(path))
    producer = {o: n for n in m.graph.node for o in n.output}
    blur = [n for n in m.graph.node if n.op_type == "Conv"][-1]
    assert producer[blur.input[1]].op_type == "DequantizeLinear"  # the buffer's int8 codes
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    y = sess.run(None, {m.graph.input[0].name: data[0].numpy()})[0]
    with torch.no_grad():
        ref = qm(data[0]).numpy()
    # the same QDQ arithmetic in float32 on both sides: float32 accumulation order only
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize(
    "option", [{"adaround": True}, {"distill_steps": 3}, {"weight_ranges": "mse"}], ids=str
)
def test_a_buffer_weight_takes_the_weight_methods(option):
    """AdaRound, distillation and mse weight ranges read each weight by name: they crashed on a
    buffer weight with torch's "`filt` is not an nn.Parameter" (sweep 2026-12-02, TResNet)."""
    torch.manual_seed(0)
    model = _Blur().eval()
    data = [torch.randn(2, 3, 16, 16) for _ in range(3)]
    recipe = dataclasses.replace(qb.Recipe.preset("default"), **option)
    qm = qb.quantize(model, data, recipe=recipe, progress=False)
    with torch.no_grad():
        got, want = qm(data[0]), model(data[0])
    # 7-bit weights and 8-bit activations on a 2-conv model: far above 20 dB from float (a
    # broken weight, e.g. a zeroed or unscaled buffer, lands below 0 dB)
    sqnr = 10 * torch.log10(want.square().mean() / (got - want).square().mean())
    assert sqnr > 20, float(sqnr)
    assert isinstance(qm.get_buffer("filt"), torch.Tensor)  # still a buffer, not a parameter
