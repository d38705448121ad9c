"""Range-group channel split (``torch.ptq._split_ranges``, ``Recipe.split_ranges``): the float
function is unchanged to float32 rounding, the cut follows the channel ranges, and per-tensor
activation grids get more accurate where a conv's channels differ ~50x in range before a
hard-swish (PP-OCRv4 det's stem, scaled down)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.torch.ptq import _split_ranges
from quantbridge.torch.ptq._split_ranges import channel_groups, split_ranges


def _seeded(*convs: nn.Conv2d) -> None:
    """Weights N(0, 0.5^2), biases N(0, 0.1^2), from one seed-0 generator, in the order given."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in convs:
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.5)
            m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)


class WideNarrow(nn.Module):
    """conv (half its channels 50x wider) -> hard-swish -> depthwise 3x3 -> 1x1 conv, and a 1x1
    conv reading the hard-swish directly: the two ways a split ends (depthwise reader split too,
    channel-mixing reader reading ``x_g * k_g``)."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 1)
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.pw = nn.Conv2d(c, c, 1)
        self.mix = nn.Conv2d(c, c, 1)
        _seeded(self.conv, self.dw, self.pw, self.mix)
        with torch.no_grad():
            spread = torch.ones(c)
            spread[: c // 2] = 50.0  # channels 0..3 50x wider, as the detector's stem
            self.conv.weight.mul_(spread.reshape(-1, 1, 1, 1))
            self.conv.bias.mul_(spread)
            self.pw.weight.div_(spread.reshape(1, -1, 1, 1))  # every channel matters downstream
            self.mix.weight.div_(spread.reshape(1, -1, 1, 1))
        self.eval()

    def forward(self, x):
        h = nn.functional.hardswish(self.conv(x))
        return self.pw(self.dw(h)) + self.mix(h)


def _data(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 10, 10, generator=g) for _ in range(n)]


def _captured(model: nn.Module) -> torch.fx.GraphModule:
    return torch.export.export(model, (_data(1, 1)[0],)).module()


def _convs(gm: torch.fx.GraphModule) -> int:
    return sum(
        n.op == "call_function" and n.target == torch.ops.aten.conv2d.default
        for n in gm.graph.nodes
    )


def test_groups_follow_the_ranges():
    lo = torch.tensor([-1.0, -50.0, -1.2, -45.0, -0.9, -52.0], dtype=torch.float64)
    assert channel_groups(lo, -lo) == [[0, 2, 4], [1, 3, 5]]
    # ranges within 2x of each other: a cut cannot lower the relative noise 4x, so no split
    even = torch.tensor([-1.0, -1.5, -2.0, -1.2], dtype=torch.float64)
    assert channel_groups(even, -even) == [[0, 1, 2, 3]]


def test_float_function_unchanged_to_float32_rounding():
    model = WideNarrow()
    gm = _captured(model)
    split = split_ranges(gm, [((x,), {}) for x in _data(2, 1)])
    assert [g["groups"] for g in split.values()] == [[[4, 5, 6, 7], [0, 1, 2, 3]]]
    # conv and depthwise one per group (2 each), pw and mix kept: 6 convs instead of 4
    assert _convs(gm) == 6
    with torch.no_grad():
        for x in _data(3, 2):
            ref = model.double()(x.double())
            model.float()
            # float32 vs float64 of one function: 2**-24 relative per op over 4 layers of short
            # sums; 1e-5 of the output's magnitude bounds it, 3 orders below one int8 step
            assert float((gm(x).double() - ref).abs().max() / ref.abs().max()) <= 1e-5


def _sqnr_db(model, q) -> float:
    with torch.no_grad():
        ref = torch.cat([model(x) for x in _data(4, 2)]).double()
        out = torch.cat([q(x) for x in _data(4, 2)]).double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def _split_gain(model) -> tuple[float, object]:
    """(SQNR gain in dB of ``split_ranges`` over the plain ``int8`` preset, the split model)."""
    base = qb.Recipe.preset("int8")
    plain = qb.quantize(model, _data(4, 1), recipe=base, progress=False)
    split = qb.quantize(model, _data(4, 1), recipe=replace(base, split_ranges=True), progress=False)
    return _sqnr_db(model, split) - _sqnr_db(model, plain), split


def test_split_lowers_the_quantized_error_and_survives_a_checkpoint(tmp_path):
    model = WideNarrow()
    # the narrow half's hard-swish inputs get a grid ~50x finer: measured 5.65 -> 26.66 dB (int8,
    # minmax); half that gain bounds it against calibration-data changes
    gain, split = _split_gain(model)
    assert gain >= 10.0, gain
    # a checkpoint replays the recorded split (groups and factors), no data needed: same outputs
    qb.save(split, tmp_path / "split.qb")
    loaded = qb.load(tmp_path / "split.qb", WideNarrow())
    assert loaded.qb_capture["split_ranges"] == split.qb_capture["split_ranges"]
    with torch.no_grad():
        for x in _data(2, 3):
            assert torch.equal(loaded(x), split(x))


class DepthwiseWide(nn.Module):
    """1x1 conv -> hard-swish -> depthwise 3x3 (half its channels 50x wider) -> hard-swish ->
    1x1 conv: the wide range appears inside the region, at the depthwise conv, as in PP-OCRv4
    det's LCNet blocks; the split must carry the depthwise conv (and its hard-swish) per group."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 1)
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.pw = nn.Conv2d(c, c, 1)
        _seeded(self.conv, self.dw, self.pw)
        with torch.no_grad():
            spread = torch.ones(c)
            spread[1::2] = 50.0  # odd channels 50x wider after the depthwise conv
            self.dw.weight.mul_(spread.reshape(-1, 1, 1, 1))
            self.dw.bias.mul_(spread)
            self.pw.weight.div_(spread.reshape(1, -1, 1, 1))
        self.eval()

    def forward(self, x):
        h = nn.functional.hardswish(self.conv(x))
        return self.pw(nn.functional.hardswish(self.dw(h)))


def test_cut_follows_every_split_tensor():
    # the conv's ranges are even, the depthwise conv's differ 50x: the cut is the depthwise's
    even = torch.tensor([-1.0, -1.1, -0.9, -1.0], dtype=torch.float64)
    wide = torch.tensor([-1.0, -50.0, -1.1, -48.0], dtype=torch.float64)
    assert channel_groups([even, wide], [-even, -wide]) == [[0, 2], [1, 3]]
    assert channel_groups([even], [-even]) == [[0, 1, 2, 3]]


def test_cut_weighs_each_channel_by_what_its_readers_take():
    # channel 3 is 50x narrower: split off where its readers amplify it (its noise reaches them
    # 100x), kept with the others where they hardly read it (a near-dead channel)
    lo = torch.tensor([-1.0, -1.1, -0.9, -0.02], dtype=torch.float64)
    read = np.array([1.0, 1.0, 1.0, 100.0])
    assert channel_groups([lo], [-lo], [read]) == [[3], [0, 1, 2]]
    ignored = np.array([1.0, 1.0, 1.0, 0.01])
    assert channel_groups([lo], [-lo], [ignored]) == [[0, 1, 2, 3]]
    # relative noise alone (no reader weights) splits it off either way
    assert channel_groups([lo], [-lo]) == [[3], [0, 1, 2]]


@pytest.fixture
def through_depthwise(monkeypatch):
    """The depthwise-in-region split (off by default: ``_split_ranges.THROUGH_DEPTHWISE``)."""
    monkeypatch.setattr(_split_ranges, "THROUGH_DEPTHWISE", True)


def test_depthwise_inside_the_region_float_unchanged(through_depthwise):
    model = DepthwiseWide()
    gm = _captured(model)
    split = split_ranges(gm, [((x,), {}) for x in _data(2, 1)])
    # cut on the depthwise conv's ranges (the 1x1 conv's are alike): even | odd channels
    assert [g["groups"] for g in split.values()] == [[[0, 2, 4, 6], [1, 3, 5, 7]]]
    assert _convs(gm) == 5  # conv and depthwise one per group, the reader kept
    with torch.no_grad():
        for x in _data(3, 2):
            ref = model.double()(x.double())
            model.float()
            # as above: float32 rounding of 3 layers, 1e-5 of the output's magnitude
            assert float((gm(x).double() - ref).abs().max() / ref.abs().max()) <= 1e-5


def test_depthwise_split_lowers_the_quantized_error(through_depthwise):
    model = DepthwiseWide()
    # the narrow half's depthwise output and hard-swish get their own grids: measured 8.14 ->
    # 28.24 dB (int8, minmax); half that gain bounds it against calibration-data changes
    gain, _ = _split_gain(model)
    assert gain >= 10.0, gain
