"""Concats joining very different ranges (``torch._ranges``): found on the first batch, their
inputs quantized on their own scales, the concat float; ``save``/``load`` replays the decision."""

from __future__ import annotations

import torch
from torch import nn

import quantbridge as qb
from quantbridge.torch._ranges import RANGE_RATIO


class _Head(nn.Module):
    """Boxes in pixels (span ~10^3) and probabilities (span < 1), joined on the channel axis."""

    def __init__(self, pixels: float = 640.0):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.box = nn.Conv2d(8, 4, 1)
        self.cls = nn.Conv2d(8, 4, 1)
        self.pixels = pixels

    def forward(self, x):
        f = torch.relu(self.stem(x))
        return torch.cat([torch.relu(self.box(f)) * self.pixels, torch.sigmoid(self.cls(f))], 1)


def _calib():
    g = torch.Generator().manual_seed(1)
    return [torch.rand(4, 3, 8, 8, generator=g) for _ in range(4)]


def test_mismatched_concat_stays_float_and_load_replays_it(tmp_path):
    """Probabilities within 0.02 of float (their own step is 1/255; one shared scale would have a
    step of ~640/255); the loaded model is bit-identical."""
    model = _Head().eval()
    qm = qb.quantize(model, _calib(), progress=False, recipe="int8")
    assert qm.qb_capture["separate_concats"] == ["cat"]
    x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y, y_float = qm(x), model(x)
    assert (y[:, 4:] - y_float[:, 4:]).abs().max() <= 0.02
    qb.save(qm, tmp_path / "head.qb")
    loaded = qb.load(tmp_path / "head.qb", _Head().eval())
    assert loaded.qb_capture["separate_concats"] == ["cat"]
    with torch.no_grad():
        assert torch.equal(loaded(x), y)


def test_close_ranges_keep_one_shared_scale():
    """Spans within RANGE_RATIO: the concat's inputs share the output's quantizer as before."""
    assert RANGE_RATIO == 16.0
    qm = qb.quantize(_Head(pixels=1.0).eval(), _calib(), progress=False, recipe="int8")
    assert qm.qb_capture["separate_concats"] == []
