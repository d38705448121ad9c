"""A conv / linear whose output only ops left float by a skip rule read (through dropout or a
reshape) keeps a float output: BERT's FFN output linears feed float residual adds, and one uint8
scale over their outlier channels was what cost MiniLM its accuracy."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantbridge as qb


class Residual(nn.Module):
    def forward(self, a, b):
        return a + b


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)
        self.res = Residual()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.res(self.drop(self.fc(x)).reshape(x.shape), x))


def _calib():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=g) for _ in range(3)]


def _activation_modules(qmodel) -> list[str]:
    return sorted(p.module for p in qmodel.qb_points if p.kind == "activation")


@pytest.mark.parametrize("skip", [False, True])
def test_output_float_only_when_every_reader_is_skipped(skip):
    rules = (qb.Rule(pattern="res", skip=True),) if skip else ()
    recipe = qb.Recipe.preset("native").with_rules(*rules)
    q = qb.quantize(Block().eval(), _calib(), recipe, progress=False)
    modules = _activation_modules(q)
    assert ("fc" in modules) is not skip, modules
    assert "head" in modules and "fc.weight" in q.quantizers()


def test_float_output_exports_and_runs(tmp_path):
    recipe = qb.Recipe.preset("native").with_rules(qb.Rule(pattern="res", skip=True))
    model = Block().eval()
    q = qb.quantize(model, _calib(), recipe, progress=False)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    path = tmp_path / "m.onnx"
    qb.export(q, path, x)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        expected = q(x).numpy()
    # node-by-node QDQ in ORT computes torch's fake-quant graph in float: the head's output
    # quantizer grid then matches to float32 rounding (a tie can flip one code: 1 step)
    step = float(q.output_quantizer().scale)
    assert np.abs(out - expected).max() <= step + 1e-6
