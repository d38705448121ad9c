"""``Recipe.float_outlier_residuals`` (preset ``transformer``): residual adds read by a layer norm
whose channels hold outliers stay float, found on the calibration data and recorded as rules.

The model is a BERT-shaped block (``LayerNorm(x + Linear(x))`` twice) whose feed-forward output
linear has one planted outlier channel (bias 200 against activations of ~1), as BERT's grow."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.recipe import Recipe, Rule
from quantbridge.torch._outliers import channel_ratio, outlier_residuals


class Output(nn.Module):
    """BERT's ``BertOutput``: ``LayerNorm(dense(h) + residual)``."""

    def __init__(self, d_in: int, d: int):
        super().__init__()
        self.dense = nn.Linear(d_in, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, h, residual):
        return self.norm(self.dense(h) + residual)


class Block(nn.Module):
    def __init__(self, d: int = 32, outlier: float = 200.0):
        super().__init__()
        torch.manual_seed(0)
        self.attention = Output(d, d)
        self.up = nn.Linear(d, 4 * d)
        self.ffn = Output(4 * d, d)
        with torch.no_grad():
            self.ffn.dense.bias[3] = outlier  # one outlier channel in the FFN residual stream

    def forward(self, x):
        a = self.attention(x, x)
        return self.ffn(torch.relu(self.up(a)), a)


def _batches(seed: int, n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 10, 32, generator=g) for _ in range(n)]


def _sqnr(reference: torch.Tensor, got: torch.Tensor) -> float:
    r, e = reference.double(), (reference - got).double()
    return float(10 * torch.log10((r**2).sum() / (e**2).sum()))


def test_channel_ratio():
    x = torch.ones(4, 5, 16)
    x[..., 2] = -100.0
    assert channel_ratio(x) == pytest.approx(100.0)
    assert channel_ratio(torch.ones(4, 1)) == 0.0  # one channel: nothing to compare


def test_finds_the_outlier_residual_only():
    model = Block().eval()
    gm = torch.export.export(model, (_batches(0)[0],)).module()
    found = outlier_residuals(gm, (_batches(0)[0],), {})
    assert list(found) == ["ffn"]  # the attention residual (ratio ~2) is left quantized
    assert found["ffn"] > 50
    assert outlier_residuals(gm, (_batches(0)[0],), {}, ratio=1e6) == {}


def test_outlier_residual_float_every_linear_int8(tmp_path):
    """Measured (torch fake-quant against float on held-out batches): all quantized 41.2 dB,
    outlier add float 67.4 dB; outlier ratio 77 (ffn) and 1.3 (attention). The 5 dB bar is far
    below the measured gain: a placement that still quantized the add's inputs or output on the
    outlier grid would lose it all."""
    model = Block().eval()
    calib, held_out = _batches(0), _batches(1)
    with torch.no_grad():
        reference = torch.cat([model(x) for x in held_out])

    def quantized(recipe):
        qmodel = qb.quantize(model, calib, recipe=recipe, progress=False)
        with torch.no_grad():
            return qmodel, torch.cat([qmodel(x) for x in held_out])

    _, plain = quantized(Recipe())
    qmodel, kept = quantized(Recipe(float_outlier_residuals=True))
    # the decision is recorded as a rule, not re-measured when the recipe is used again
    assert qmodel.qb_recipe.rules == (Rule(pattern="ffn", skip=True),)
    assert qmodel.qb_recipe.float_outlier_residuals is False
    weights = {p.module for p in qmodel.qb_points if p.kind == "weight"}
    assert weights == {"attention.dense", "up", "ffn.dense"}  # every linear still int8
    gain = _sqnr(reference, kept) - _sqnr(reference, plain)
    assert gain >= 5.0, (_sqnr(reference, plain), _sqnr(reference, kept))

    qb.save(qmodel, tmp_path / "m.safetensors")
    loaded = qb.load(tmp_path / "m.safetensors", Block().eval())
    with torch.no_grad():
        again = torch.cat([loaded(x) for x in held_out])
    assert torch.equal(again, kept)


def test_recipe_field_round_trip_and_preset():
    preset = Recipe.preset("transformer")
    assert preset.float_outlier_residuals and preset.smoothquant == "auto"
    assert Recipe.from_dict(preset.to_dict()) == preset
    assert Recipe.from_yaml(preset.to_yaml()) == preset
    # recipes without the option serialise as before (saved checkpoints and files unchanged)
    assert "float_outlier_residuals" not in Recipe().to_dict()
    assert dataclasses.replace(preset, float_outlier_residuals=False).to_dict() == (
        dataclasses.replace(Recipe(), smoothquant="auto").to_dict()
    )
    assert np.isfinite(Recipe.from_dict({"float_outlier_residuals": True}).weights.scheme.bits)
