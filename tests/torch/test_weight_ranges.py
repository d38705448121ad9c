"""``Recipe.weight_ranges`` (``torch.ptq._weight_ranges``): each per-channel weight scale is
``numerics.weighted_mse_scales`` of the layer's weight, with the importance ``E[x^2]`` of each
weight's input recomputed here independently (im2col by ``F.unfold`` of the float model's input,
zero padding included, float64); the default ("minmax") is unchanged."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantbridge as qb
from quantbridge.numerics import weighted_mse_scales
from quantbridge.torch.ptq._adaround import weighted_layers


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 5),
    ).eval()
    with torch.no_grad():  # heavy-tailed weights (Student t, 2 dof): clipping pays somewhere
        for mod in m:
            if isinstance(mod, (nn.Conv2d, nn.Linear)):
                mod.weight.copy_(torch.distributions.StudentT(2.0).sample(mod.weight.shape) * 0.05)
    return m


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # per-channel input scales and means differ: the importance then differs across a row's weights
    return [
        torch.randn(4, 3, 6, 6, generator=g) * torch.tensor([0.2, 1.0, 3.0])[:, None, None] + 0.5
    ]


def _importance(m, data, centered) -> list[np.ndarray]:
    """Per weighted layer of ``m``, E[x_j^2] (``centered``: Var(x_j)) per weight as (out
    channels, fan-in), float64."""
    inputs: dict = {}
    hooks = [
        mod.register_forward_pre_hook(lambda mod, a: inputs.setdefault(mod, []).append(a[0]))
        for mod in m
        if isinstance(mod, (nn.Conv2d, nn.Linear))
    ]
    with torch.no_grad():
        for x in data:
            m(x)
    for h in hooks:
        h.remove()
    found = []
    for mod, xs in inputs.items():
        x = torch.cat(xs).double()
        if isinstance(mod, nn.Linear):
            d = x.var(0, correction=0) if centered else (x * x).mean(0)
            d = d[None].expand(mod.out_features, -1)
        else:
            cols = F.unfold(x, mod.kernel_size, padding=mod.padding)  # (N, C*k*k, L)
            cols = cols.transpose(1, 2).reshape(-1, cols.shape[1])  # (positions, taps)
            # input channel major, as weight.reshape(out, -1)
            sq = cols.var(0, correction=0) if centered else (cols * cols).mean(0)
            g = mod.groups
            d = sq.reshape(g, 1, -1).expand(g, mod.out_channels // g, -1)
            d = d.reshape(mod.out_channels, -1)
        found.append(d.numpy())
    return found


@pytest.mark.parametrize(
    ("mode", "bias_correction"), [("output", False), ("output", True), ("mse", False)]
)
def test_scales_are_the_weighted_mse_argmin(mode, bias_correction):
    """With bias correction "output" counts Var(x_j): the correction removes the error's mean."""
    m, data = _model(), _data()
    # 4-bit weights: clipping pays on some channels there (at 8 bits, with these few weights per
    # channel, the plain squared error never clips)
    recipe = dataclasses.replace(
        qb.Recipe.preset("w4a8"), weight_ranges=mode, bias_correction=bias_correction
    )
    qm = qb.quantize(m, data, recipe=recipe, progress=False)
    layers = weighted_layers(qm)
    importance = _importance(m, data, bias_correction)
    assert len(layers) == len(importance) == 3
    clipped = 0
    for layer, d in zip(layers, importance, strict=True):
        q = layer.quantizer
        w = layer.weight.detach().double().reshape(layer.weight.shape[0], -1).numpy()
        want = weighted_mse_scales(w, q.qmin, q.qmax, d if mode == "output" else None)
        # the importance sums run in another order here: scales agree to the last bit except
        # where two clip ratios' errors tie to float64 rounding (none on this data)
        np.testing.assert_array_equal(q.scale.numpy(), want)
        clipped += int((want < np.abs(w).max(1) / q.qmax * (1 - 1e-6)).sum())
    assert clipped > 0  # some channel is clipped: the option did something


def test_minmax_is_the_default_and_bad_values_are_refused():
    assert qb.Recipe().weight_ranges == "minmax"
    m, data = _model(), _data()
    qm = qb.quantize(m, data, recipe="int8", progress=False)
    for layer in weighted_layers(qm):
        w = layer.weight.detach().reshape(layer.weight.shape[0], -1)
        want = (w.abs().amax(1).double() / layer.quantizer.qmax).float()
        torch.testing.assert_close(layer.quantizer.scale, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="weight_ranges"):
        qb.Recipe(weight_ranges="hessian")
    r = dataclasses.replace(qb.Recipe(), weight_ranges="output")
    assert qb.Recipe.from_dict(r.to_dict()).weight_ranges == "output"
