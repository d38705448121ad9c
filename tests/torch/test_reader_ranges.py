"""``Recipe(reader_bounds=True)``: calibration observes a value clamped to the interval its
readers tell apart (``_reader_ranges``).

A conv output read only by a decomposed hard-swish ``x * clamp(x + 3, 0, 6) / 6`` (Paddle2ONNX,
PP-LCNet) is 0 below -3 whatever x is, so its grid need not reach the conv's large negative
values; a value read by anything else keeps its whole range. Checked: which quantizers get bounds,
that the frozen grid is the minmax grid of the clamped float values (float64 recomputation), that
the hard-swish output's error falls, and that ONNX Runtime (node by node) agrees with torch.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.numerics import PerTensor, QScheme, choose_qparams
from quantbridge.recipe import Recipe
from quantbridge.torch._reader_ranges import reader_bounds
from quantbridge.torch._record import CONTAINER


class HswishBlock(nn.Module):
    """conv -> x * clamp(x + 3, 0, 6) / 6 -> conv, with a channel far below -3 (an outlier that
    the hard-swish maps to 0), and a second conv whose output a conv also reads."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 1)
        self.conv2 = nn.Conv2d(8, 4, 1)
        self.conv3 = nn.Conv2d(3, 4, 1)
        self.conv4 = nn.Conv2d(4, 4, 1)
        with torch.no_grad():
            self.conv1.bias[0] = -60.0  # channel 0 spans about [-62, -58]: hard-swish gives 0

    def forward(self, x):
        y = self.conv1(x)
        h = y * torch.clamp(y + 3.0, 0.0, 6.0) / 6.0
        z = self.conv3(x)
        g = z * torch.clamp(z + 3.0, 0.0, 6.0) / 6.0
        return self.conv2(h), self.conv4(z) + g, h  # z is read in full by conv4: no bounds


def _data(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, 6, 6, generator=g) for _ in range(n)]


BOUNDED = replace(Recipe.preset("int8"), reader_bounds=True)


def _quantize(model, recipe=BOUNDED):
    return qb.quantize(model, _data(), recipe=recipe, progress=False)


@pytest.fixture(scope="module")
def block():
    model = HswishBlock().eval()
    return model, _quantize(model)


def _bounded(q) -> dict[str, tuple[float, float]]:
    return reader_bounds(q)


def test_only_the_value_hardswish_alone_reads_gets_a_floor(block):
    _, q = block
    bounds = _bounded(q)
    assert list(bounds.values()) == [(-3.0, float("inf"))]
    (attr,) = bounds
    assert "conv1" in attr, attr
    assert getattr(q.get_submodule(CONTAINER), attr).observe_bounds == (-3.0, float("inf"))


def test_frozen_grid_is_the_minmax_grid_of_the_clamped_values(block):
    model, q = block
    (attr,) = _bounded(q)
    quantizer = getattr(q.get_submodule(CONTAINER), attr)
    with torch.no_grad():  # float64 recomputation of conv1's output over the calibration data
        w = model.conv1.weight.double()
        b = model.conv1.bias.double()
        ys = [torch.nn.functional.conv2d(x.double(), w, b) for x in _data()]
    lo = min(float(y.min()) for y in ys)
    hi = max(float(y.max()) for y in ys)
    assert lo < -50  # the outlier channel is there, and the grid ignores it
    uint8 = QScheme(8, False, False, False, PerTensor())
    scale, zp = choose_qparams(np.float64(max(lo, -3.0)), np.float64(hi), uint8)
    # calibration runs conv1 on its quantized input with its fake-quantized weights: the range
    # moves by a few weight / input steps from the float one (measured 0.1%), never by the
    # outlier's 60 / 255 (the unclamped grid's step is 3x larger)
    np.testing.assert_allclose(float(quantizer.scale), float(scale), rtol=0.01)
    assert abs(int(quantizer.zero_point) - int(zp)) <= 1


def _hardswish_error(q, model) -> float:
    """Mean error of the hard-swish's output against float, on held-out data."""
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return float((q(x)[2] - model(x)[2]).abs().mean())


def test_bounds_lower_the_error_after_the_hardswish(block):
    model, q = block
    bounded = _hardswish_error(q, model)
    whole = _hardswish_error(_quantize(model, Recipe.preset("int8")), model)  # option off
    # conv1's grid step falls from ~(62 + 3) / 255 to ~6 / 255; the hard-swish's own output
    # grid (~3.4 / 255) then bounds the error: more than halved
    assert bounded < whole / 2, (bounded, whole)


def test_onnx_runtime_agrees_node_by_node(block, tmp_path):
    _, q = block
    path = tmp_path / "hswish.onnx"
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(3))
    qb.export(q, path, example_inputs=(x,))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        expected = [t.numpy() for t in q(x)]
    for out, (g, e) in enumerate(zip(got, expected, strict=True)):
        step = float(_output_scale(q, out))
        # same QDQ arithmetic in float32: at most one rounding tie apart (1 LSB of the output)
        assert np.abs(g - e).max() <= step * 1.001, (out, np.abs(g - e).max(), step)


def _output_scale(q, index: int) -> torch.Tensor:
    """The scale of the activation quantizer right before graph output ``index``."""
    out = next(n for n in q.graph.nodes if n.op == "output")
    node = out.args[0][index]
    while not (node.op == "call_module" and str(node.target).startswith(CONTAINER)):
        node = node.args[0]
    return q.get_submodule(node.target).scale


READERS = {  # conv index -> (reader, the interval calibration observes; None: the whole value)
    # conv -> relu / clamp: placement quantizes after the activation, no quantizer in between
    0: (torch.relu, None),
    1: (lambda y: torch.clamp(y, -1.0, 2.0), None),
    2: (lambda y: y * torch.clamp(y + 3.0, 0.0, 6.0), (-3.0, float("inf"))),
    3: (lambda y: y * torch.clamp(y + 3.0, 0.0, 6.0) + y, None),  # y also read in full
    4: (lambda y: y * torch.clamp(y + 2.0, -1.0, 6.0), None),  # the gate is not 0 below -2
    5: (torch.sigmoid, None),
}


class Readers(nn.Module):
    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3, 4, 1) for _ in READERS)

    def forward(self, x):
        return tuple(READERS[i][0](conv(x)) for i, conv in enumerate(self.convs))


def test_reader_intervals():
    """Which readers bound a value, one model (one capture) for all of them."""
    bounds = _bounded(_quantize(Readers()))
    found = {int(attr.split("convs_")[1].split("_")[0]): v for attr, v in bounds.items()}
    assert found == {i: e for i, (_, e) in READERS.items() if e is not None}, bounds


MSE = replace(Recipe.preset("int8"), activations=replace(Recipe().activations, method="mse"))


def _conv1_grid(q) -> tuple[float, float, tuple | None]:
    """(lowest grid value, step, observe_bounds) of conv1's output quantizer."""
    (attr,) = reader_bounds(q)  # the site, found from the graph whatever the option
    quantizer = getattr(q.get_submodule(CONTAINER), attr)
    scale = float(quantizer.scale)
    return -int(quantizer.zero_point) * scale, scale, quantizer.observe_bounds


def test_every_method_bounds_an_mse_calibrated_value():
    """``reader_bounds="all"``: an mse-calibrated value only the hard-swish reads gets the bounds
    too. conv1's outlier channel spans about [-62, -58]: 1 of 8 channels, not a rare tail, so
    mse keeps it (grid from below -50); on the clamped values the grid starts within a step of
    -3 (min-max of the clamped values is exactly -3; mse may clip, never extend, the range)."""
    model = HswishBlock().eval()
    lo_true, _, bounds_true = _conv1_grid(_quantize(model, replace(MSE, reader_bounds=True)))
    assert bounds_true is None and lo_true < -50, lo_true  # True: minmax only, as before
    lo, step, bounds = _conv1_grid(_quantize(model, replace(MSE, reader_bounds="all")))
    assert bounds == (-3.0, float("inf"))
    assert -3.0 - step <= lo <= 0.0, (lo, step)


def test_reader_bounds_mode_round_trips_and_is_checked():
    r = replace(MSE, reader_bounds="all")
    assert Recipe.from_dict(r.to_dict()).reader_bounds == "all"
    assert Recipe.from_dict(replace(MSE, reader_bounds=True).to_dict()).reader_bounds is True
    with pytest.raises(ValueError, match="reader_bounds"):
        replace(MSE, reader_bounds="some")
