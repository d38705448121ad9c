"""Weight standardization: ``F.batch_norm(w, None, None, training=True)`` on a conv weight
(timm's ``StdConv2d``, HF BiT's ``WeightStandardizedConv2d``, NFNets). A batch norm without
running statistics normalizes by its input's statistics in every mode, so capture and
``train()``/``eval()`` must leave its ``training`` flag alone."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import nn

import quantbridge as qb


class _StdConv(nn.Conv2d):
    def forward(self, x):
        w = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1), None, None, training=True,
            momentum=0.0, eps=1e-6,
        ).reshape_as(self.weight)  # fmt: skip
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class _BitBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = _StdConv(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.conv2 = _StdConv(8, 4, 3)

    def forward(self, x):
        return self.conv2(F.relu(self.norm(self.conv1(x))))


def test_weight_standardization_quantizes_exports_and_trains(tmp_path):
    """Regression: capture set the statistics-free batch norm to ``training=False`` and
    calibration failed with "running_mean must be defined in evaluation mode" (HF BiT)."""
    torch.manual_seed(0)
    model = _BitBlock().eval()
    data = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    qmodel = qb.quantize(model, data, progress=False)
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad(), qb.float_mode(qmodel):
        torch.testing.assert_close(qmodel(x), model(x))  # quantizers off: the float model
    with torch.no_grad():
        y = qmodel(x).numpy()
    qb.export(qmodel, tmp_path / "m.onnx", x)
    options = ort.SessionOptions()  # the QDQ graph as written: ORT's fused QLinearConv may
    # round a code 1 LSB the other way, and the GroupNorm after it amplifies such flips
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    (got,) = ort.InferenceSession(str(tmp_path / "m.onnx"), options).run(None, {"x": x.numpy()})
    # the same integer weights and scales; only float summation order differs (float output)
    np.testing.assert_allclose(got, y, rtol=0, atol=1e-4 * np.abs(y).max())
    qmodel.train()  # QAT: the flag flip must skip the statistics-free batch norm too
    qmodel(x).sum().backward()
    assert qmodel.get_parameter("conv1.weight").grad is not None
