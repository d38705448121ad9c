"""Empirical bias correction (``torch.ptq._bias_correction``): the quantized model's mean output
error against the float model falls, on a net where per-tensor weights shift it (depthwise)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_ptq_equalize import DepthwiseNet, _data, _recipe

import quantbridge as qb


def _errors(model, qmodel, batches) -> tuple[float, float]:
    """(mean over classes of |mean error|, mean squared error) against the float64 model."""
    with torch.no_grad():
        ref = torch.cat([model.double()(x.double()) for x in batches])
        model.float()
        err = torch.cat([qmodel(x).double() for x in batches]) - ref
    return float(err.mean(0).abs().mean()), float(err.pow(2).mean())


def _quantized(model, calib, bias_correction, **kw):
    recipe = dataclasses.replace(_recipe(False), bias_correction=bias_correction)
    return qb.quantize(model, calib, recipe, progress=False, **kw)


@pytest.mark.parametrize(
    "variant, mean_factor, mse_factor",
    # measured on held-out data (not the calibration batches): mean error 1.13 -> 0.25 (one
    # pass) / 0.012 (sequential), mse 2.65 -> 0.086 / 0.0022; per-tensor weights on this net
    # shift every class's mean by ~1 (output std ~4.8)
    [(True, 3.0, 10.0), ("sequential", 20.0, 20.0)],
)
def test_bias_correction_lowers_mean_output_error(variant, mean_factor, mse_factor):
    model = DepthwiseNet()
    calib, held_out = _data(8, 1), _data(4, 2)
    plain = _quantized(model, calib, False)
    corrected = _quantized(model, calib, variant)
    mean_before, mse_before = _errors(model, plain, held_out)
    mean_after, mse_after = _errors(model, corrected, held_out)
    print(
        f"{variant}: mean error {mean_before:.4f} -> {mean_after:.4f}, mse {mse_before:.4f} -> {mse_after:.4f}"
    )
    assert mean_after < mean_before / mean_factor
    assert mse_after < mse_before / mse_factor
    # the correction went into the float biases, and only the biases
    for name, p in plain.named_parameters():
        q = corrected.get_parameter(name)
        assert torch.equal(p, q) == (not name.endswith("bias")), name


def test_bias_correction_with_forward_loop_matches_calib_data():
    model = DepthwiseNet()
    calib = _data(4, 1)

    def loop(m):
        for x in calib:
            m(x)

    a = _quantized(model, calib, "sequential")
    b = _quantized(model, None, "sequential", forward_loop=loop)
    for name, p in a.named_parameters():
        assert torch.equal(p, b.get_parameter(name)), name


def test_bias_correction_survives_save_and_load(tmp_path):
    model = DepthwiseNet()
    calib = _data(4, 1)
    q = _quantized(model, calib, True)
    qb.save(q, tmp_path / "m.qb")
    loaded = qb.load(tmp_path / "m.qb", model)
    x = _data(1, 3)[0]
    with torch.no_grad():
        assert torch.equal(q(x), loaded(x))
