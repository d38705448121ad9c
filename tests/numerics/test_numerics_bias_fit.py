"""``fit_weight_scale_to_bias``: the int32 bias never saturates, and nothing moves that fit.

Reference: float64 recomputation of ``bias / (input_scale * weight_scale)`` with the float32
product ``bias_scale`` stores (the scale an engine reads)."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from quantbridge.numerics import (
    MIN_SCALE,
    bias_scale,
    fit_weight_scale_to_bias,
    is_power_of_two,
    quantize_bias,
)

INT32_MAX = 2**31 - 1
biases = arrays(np.float32, st.integers(1, 6), elements=st.floats(-1e7, 1e7, width=32))
input_scales = st.floats(2.0**-20, 1e3, width=32)
# weight scales from the floor (an all-zero channel) up to coarse ones
weight_scales = st.floats(MIN_SCALE, 10.0, width=32)


def _check(bias, s_x, s_w, fitted, per_channel):
    step = bias_scale(s_x, fitted).astype(np.float64)
    q = quantize_bias(bias, s_x, fitted).astype(np.int64)
    # in range and not clipped: |b / step| <= INT32_MAX, so round() lands within half a step
    assert np.all(np.abs(bias.astype(np.float64) / step) <= INT32_MAX)
    assert np.all(np.abs(q) <= INT32_MAX)
    assert np.all(np.abs(q * step - bias.astype(np.float64)) <= step / 2)
    assert np.all(fitted >= s_w)
    old_step = bias_scale(s_x, s_w).astype(np.float64)
    need = np.abs(bias.astype(np.float64)) if per_channel else np.abs(bias).max()
    fits = need <= old_step * INT32_MAX
    # a scale whose bias already fitted is returned bit for bit
    assert np.array_equal(np.where(fits, fitted, s_w), np.broadcast_to(s_w, fitted.shape))
    return need, fits


@settings(max_examples=200, deadline=None)
@given(bias=biases, s_x=input_scales, data=st.data())
def test_fitted_bias_codes_stay_in_int32_within_half_a_step(bias, s_x, data):
    s_w = np.array(
        data.draw(st.lists(weight_scales, min_size=bias.size, max_size=bias.size)), np.float32
    )
    fitted = fit_weight_scale_to_bias(bias, s_x, s_w)
    need, fits = _check(bias, s_x, s_w, fitted, per_channel=True)
    # raised no further than needed: within 2 float32 ulps of the exact smallest scale
    exact = need / (np.float64(np.float32(s_x)) * INT32_MAX)
    assert np.all(fits | (fitted <= exact * (1 + 2.0**-22)))


@settings(max_examples=100, deadline=None)
@given(bias=biases, s_x=input_scales, s_w=weight_scales, pow2=st.booleans())
@example(bias=np.array([1.0], np.float32), s_x=2.0**-8, s_w=2.0**-23, pow2=True)
def test_one_weight_scale_fits_the_largest_bias(bias, s_x, s_w, pow2):
    s_w = np.float32(s_w)
    if pow2:
        s_w = np.float32(2.0 ** np.ceil(np.log2(s_w)))
    fitted = fit_weight_scale_to_bias(bias, s_x, np.array(s_w), pow2=pow2)
    assert fitted.shape == ()
    _, fits = _check(bias, s_x, np.array(s_w), fitted, per_channel=False)
    if pow2:
        assert is_power_of_two(float(fitted))
        # the smallest power of two that fits: half of it would saturate
        # (in float64: float32 rounds INT32_MAX up to 2**31, so a code of exactly 2**31 read as
        # "not above" it; hypothesis found bias 1, s_x 2**-8, s_w 2**-23)
        half = np.float64(np.float32(s_x)) * (np.float64(fitted) / 2)
        assert fits or np.rint(np.float64(np.abs(bias).max()) / half) > INT32_MAX


def test_dead_channel_bias_behind_a_fine_input_step():
    """The issue's case: an all-zero channel (scale 2**-23), bias 5, input step 0.01."""
    bias = np.array([5.0, 0.3], np.float32)
    s_w = np.array([MIN_SCALE, 0.02], np.float32)
    assert quantize_bias(bias, 0.01, s_w)[0] == INT32_MAX  # saturated: 5 read back as 2.56
    fitted = fit_weight_scale_to_bias(bias, 0.01, s_w)
    assert fitted[1] == s_w[1] and fitted[0] > s_w[0]
    q = quantize_bias(bias, 0.01, fitted)
    step = bias_scale(0.01, fitted).astype(np.float64)
    np.testing.assert_allclose(q * step, bias, rtol=0, atol=step.max() / 2)


def test_bias_along_another_axis_and_bad_input():
    bias = np.zeros((2, 3), np.float32)
    bias[1, 2] = 100.0
    fitted = fit_weight_scale_to_bias(bias, 0.01, np.full(3, MIN_SCALE, np.float32), axis=1)
    assert fitted[0] == fitted[1] == MIN_SCALE and fitted[2] > MIN_SCALE
    with pytest.raises(ValueError, match="NaN or inf"):
        fit_weight_scale_to_bias(np.array([np.nan]), 0.01, np.ones(1, np.float32))
