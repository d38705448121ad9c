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
    q = qb.quantize(_PadConv(pad), calib, recipe="int8", progress=False)
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
