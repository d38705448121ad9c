"""AdaRound's formulas (``numerics._adaround``) against one-line float64 references: every hard
code is floor or ceil of ``w / s`` (saturated), the rectified sigmoid and its inverse round-trip,
the soft code at its start is the float weight, numpy and torch agree bit for bit."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from quantbridge.numerics import (
    adaround_quantize,
    beta_schedule,
    dequantize,
    floor_codes,
    hard_rounding,
    rectified_sigmoid,
    rectified_sigmoid_inverse,
    rounding_regularizer,
)

weights = arrays(np.float32, (4, 6), elements=st.floats(-10, 10, width=32))
scales = arrays(np.float32, (4,), elements=st.floats(0.0009765625, 1.0, width=32))


@settings(max_examples=200, deadline=None)
@given(w=weights, scale=scales, up=arrays(np.bool_, (4, 6)))
def test_hard_codes_are_floor_or_ceil_of_w_over_s_saturated(w, scale, up):
    down, frac = floor_codes(w, scale, axis=0)
    up = hard_rounding(np.where(up, 1.0, -1.0), frac)  # V >= 0 where up; never up at an integer
    codes = adaround_quantize(down, up, np.zeros(4), -127, 127, axis=0)
    # w / s as ONNX QuantizeLinear defines it: one float32 division (float64 would differ where
    # the float32 quotient rounds onto an integer: 1 / 0.33333334 is 3.0 in float32, 2.9999999
    # in float64 - hypothesis found it), then floor / ceil exactly in float64
    exact = (w / scale[:, None]).astype(np.float64)
    lo, hi = np.clip(np.floor(exact), -127, 127), np.clip(np.ceil(exact), -127, 127)
    assert np.all((codes == lo) | (codes == hi))
    assert np.array_equal(
        codes, np.clip(np.where(up > 0, np.ceil(exact), np.floor(exact)), -127, 127)
    )
    assert np.all((frac >= 0) & (frac <= 1))  # 1.0 where a tiny negative w/s rounds: -1e-38 + 1


def test_saturation_and_zero_point():
    down, _ = floor_codes(np.array([np.inf, -np.inf, 1e9, 2.6, -2.6], np.float32), np.float32(1.0))
    codes = adaround_quantize(down, np.float32(1.0), 3, 0, 255)
    # +inf / 1e9 saturate at qmax, -inf at qmin; 2.6 -> floor 2 + 1 + z 3 = 6; -2.6 -> -3 + 1 + 3
    assert codes.tolist() == [255.0, 0.0, 255.0, 6.0, 1.0]


@settings(max_examples=200, deadline=None)
@given(h=st.floats(0.0, 1.0))
def test_rectified_sigmoid_inverse_round_trips(h):
    v = rectified_sigmoid_inverse(np.float64(h))
    assert np.isfinite(v)
    # sigmoid of a float64 V: a few ulps of rounding, far below a rounding decision's 0.5
    assert abs(rectified_sigmoid(v) - h) <= 1e-12


def test_rectified_sigmoid_reaches_0_and_1_at_finite_v():
    v = np.array([-50.0, -3.0, 0.0, 3.0, 50.0])
    h = rectified_sigmoid(v)
    assert h[0] == 0.0 and h[-1] == 1.0 and h[2] == pytest.approx(0.5)
    # the reference formula, one line
    ref = np.clip(1 / (1 + np.exp(-v)) * (1.1 - -0.1) + -0.1, 0, 1)
    assert np.array_equal(h, ref)


@settings(max_examples=100, deadline=None)
@given(w=weights, scale=scales)
def test_soft_start_is_the_float_weight(w, scale):
    """``h = frac(w / s)`` at the start: the soft weight equals ``w`` up to float32 rounding."""
    down, frac = floor_codes(w, scale, axis=0)
    codes = adaround_quantize(down, frac, np.zeros(4), -20000, 20000, axis=0)  # no clipping
    back = dequantize(codes, scale, np.zeros(4, np.int32), axis=0)
    # (floor + frac) * s: float32 roundings of t - floor(t), the sum and the product
    tol = 2.0**-22 * np.maximum(np.abs(w), scale[:, None]) * 4
    assert np.all(np.abs(back - w) <= tol)


@settings(max_examples=50, deadline=None)
@given(w=weights, scale=scales, up=arrays(np.float32, (4, 6), elements=st.floats(0, 1, width=32)))
def test_numpy_and_torch_agree_bit_for_bit(w, scale, up):
    d_np, f_np = floor_codes(w, scale, axis=0)
    d_t, f_t = floor_codes(torch.from_numpy(w), torch.from_numpy(scale), axis=0)
    assert np.array_equal(d_np, d_t.numpy()) and np.array_equal(f_np, f_t.numpy())
    c_np = adaround_quantize(d_np, up, np.zeros(4), -127, 127, axis=0)
    c_t = adaround_quantize(d_t, torch.from_numpy(up), torch.zeros(4), -127, 127, axis=0)
    assert np.array_equal(c_np, c_t.numpy())
    v = np.linspace(-8, 8, 33, dtype=np.float32)
    assert np.allclose(
        rectified_sigmoid(v), rectified_sigmoid(torch.from_numpy(v)).numpy(), rtol=0, atol=1e-6
    )  # exp differs by an ulp between libms


def test_regularizer_and_beta_schedule():
    assert rounding_regularizer(np.array([0.0, 1.0, 1.0, 0.0]), 2.0) == 0.0
    assert rounding_regularizer(np.array([0.5, 0.5]), 20.0) == 1.0
    # 1 - |2 * 0.75 - 1| ** 2 = 0.75, mean with a hard 0 -> 0.375
    assert rounding_regularizer(np.array([0.75, 0.0]), 2.0) == pytest.approx(0.375)
    betas = [beta_schedule(t, 100, 20.0, 2.0, 0.2) for t in range(100)]
    assert betas[:20] == [20.0] * 20 and betas[20] == 20.0 and betas[-1] == 2.0
    assert all(a >= b for a, b in zip(betas, betas[1:], strict=False))
