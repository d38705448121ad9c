"""numerics.weighted_rounding_error / weighted_mse_scales against float64 references."""

import numpy as np
import pytest

from quantbridge.numerics import weighted_mse_scales, weighted_rounding_error


def _fq64(w, s, qmin, qmax):
    # independent float64 reference of fake quantization with zero point 0 (numpy's rint is
    # round half to even, as ``quantize``)
    return np.clip(np.rint(w / s[:, None]), qmin, qmax) * s[:, None]


def test_weighted_error_is_the_output_error_of_uncorrelated_inputs():
    """The defining property: for inputs with a diagonal second moment E[x x^T] = diag(d) the
    layer's mean squared output error from the weight rounding, E[((w - q(w)) x)^2] per output
    channel, equals sum_j d_j (w_ij - q(w_ij))^2. Checked exactly on a sample whose second
    moment is exactly diagonal (x = ±sqrt(d_j) e_j, every basis vector with both signs)."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 10))
    d = rng.uniform(0.01, 5.0, size=10)
    s = (np.abs(w).max(1) * 0.8 / 127).astype(np.float32).astype(np.float64)
    x = np.concatenate([np.diag(np.sqrt(d)), -np.diag(np.sqrt(d))])  # E[x x^T] = diag(d) / 10
    e = w - _fq64(w, s, -128, 127)
    output_mse = ((x @ e.T) ** 2).mean(0) * 10  # * 10 undoes the 1/10 of the 20-sample mean
    got = weighted_rounding_error(w, s, -128, 127, d)
    np.testing.assert_allclose(got, output_mse, rtol=1e-12)  # float64 sums of 10-20 terms


def test_scales_are_the_argmin_over_ratios_with_ties_to_the_wider_grid():
    rng = np.random.default_rng(1)
    w = rng.standard_t(3, size=(16, 64))  # heavy tails, a 4-bit grid: clipping pays for some
    d = rng.uniform(0.0, 3.0, size=(16, 64))
    ratios = tuple(np.linspace(1.0, 0.5, 21))
    got = weighted_mse_scales(w, -8, 7, d, ratios)
    amax = np.abs(w).max(1)
    cand = np.stack([(amax * r / 7).astype(np.float32).astype(np.float64) for r in ratios])
    errs = np.stack([(d * (w - _fq64(w, c, -8, 7)) ** 2).sum(1) for c in cand])
    best = errs.argmin(0)  # argmin returns the first minimum: the earlier (wider) ratio on ties
    np.testing.assert_array_equal(got, cand[best, np.arange(16)].astype(np.float32))
    assert (best > 0).any() and (best == 0).any()  # the data exercise both outcomes
    # unit importance = plain squared weight error; a channel with zero importance keeps ratio 1
    np.testing.assert_array_equal(
        weighted_mse_scales(w, -8, 7, None, ratios),
        weighted_mse_scales(w, -8, 7, np.ones_like(w), ratios),
    )
    d0 = d.copy()
    d0[3] = 0.0
    assert weighted_mse_scales(w, -8, 7, d0, ratios)[3] == np.float32(amax[3] / 7)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="2-D"):
        weighted_mse_scales(np.ones(3), -128, 127)
    with pytest.raises(ValueError, match="importance"):
        weighted_mse_scales(np.ones((2, 3)), -128, 127, -np.ones((2, 3)))
