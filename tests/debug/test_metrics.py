"""Metrics and classes of one tensor pair, against float64 one-line references."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from quantbridge.debug._classify import classify
from quantbridge.debug._metrics import HIST_CLIP, tensor_metrics

codes = arrays(np.int64, st.integers(1, 64), elements=st.integers(0, 255))


@settings(max_examples=60, deadline=None)
@given(codes, codes, st.floats(1e-3, 10.0), st.integers(0, 255))
def test_metrics_match_float64_reference(qa, qb_, scale, zero):
    n = min(qa.size, qb_.size)
    qa, qb_ = qa[:n], qb_[:n]
    a, b = scale * (qa - zero), scale * (qb_ - zero)
    m = tensor_metrics(a, b, scale)
    e = b - a
    assert m["max_abs"] == pytest.approx(np.abs(e).max(), rel=1e-12)
    assert m["mean_abs"] == pytest.approx(np.abs(e).mean(), rel=1e-12)
    if np.any(e) and np.any(a):
        assert m["sqnr_db"] == pytest.approx(10 * math.log10((a**2).sum() / (e**2).sum()))
    else:
        assert m["sqnr_db"] is None
    # values on one grid: the LSB error is the code difference exactly
    d = np.abs(qb_ - qa)
    share = m["lsb_share"]
    assert share["0"] == np.mean(d == 0) and share["1"] == np.mean(d == 1)
    assert share["2"] == np.mean(d == 2) and share[">2"] == np.mean(d > 2)
    assert sum(share.values()) == pytest.approx(1.0)
    hist = dict((k, c) for k, c in m["lsb_hist"])
    assert sum(hist.values()) == n and set(hist) == set(range(-HIST_CLIP, HIST_CLIP + 1))
    assert hist[0] == np.sum(d == 0)
    assert hist[HIST_CLIP] == np.sum(qb_ - qa >= HIST_CLIP)
    assert m["max_lsb"] == pytest.approx(d.max(), abs=1e-6)
    assert -1.0 <= m["cosine"] <= 1.0


def test_metrics_without_scale_have_no_lsb_fields():
    m = tensor_metrics(np.ones(4), np.ones(4) * 1.5, None)
    assert m["lsb_share"] is None and m["lsb_hist"] is None and m["max_lsb"] is None
    assert m["max_abs"] == 0.5 and m["cosine"] == pytest.approx(1.0)


def test_metrics_refuse_different_shapes():
    with pytest.raises(ValueError, match=r"shapes differ: \(4,\) against \(2, 2\)"):
        tensor_metrics(np.zeros(4), np.zeros((2, 2)), 0.1)


def _m(max_abs, max_lsb):
    return {"max_abs": max_abs, "max_lsb": max_lsb}


@pytest.mark.parametrize(
    ("metrics", "a_float", "b_float", "expected"),
    [
        (_m(0.0, 0.0), True, False, "exact"),
        (_m(0.3, 3.0), True, False, "quantization noise"),
        (_m(0.3, 3.0), False, True, "quantization noise"),
        (_m(0.1, 1.0), False, False, "rounding"),
        (_m(0.1000001, 1.000001), False, False, "rounding"),  # float32 dequantization noise
        (_m(0.2, 2.0), False, False, "divergence"),
        (_m(0.05, None), False, False, "rounding"),  # float tensor, 0.5% of the peak
        (_m(0.5, None), False, False, "divergence"),
    ],
)
def test_classes_follow_the_documented_thresholds(metrics, a_float, b_float, expected):
    assert classify(metrics, a_float=a_float, b_float=b_float, reference_peak=10.0) == expected


@pytest.mark.parametrize(
    ("max_lsb", "carried", "expected"),
    [(5.0, 0.0, "divergence"), (5.0, 0.4, "rounding"), (5.0, 0.39, "divergence")],
)
def test_error_carried_from_the_inputs_plus_one_step_is_rounding(max_lsb, carried, expected):
    # step 0.1: 5 steps = 0.5 of error; explained when the inputs carried >= 0.4 (0.5 - 1 step)
    m = _m(max_lsb * 0.1, max_lsb)
    got = classify(m, a_float=False, b_float=False, reference_peak=10.0, carried=carried, scale=0.1)
    assert got == expected


def test_float_tensor_differences_at_float32_noise_are_rounding():
    # PP-OCRv4 det's Sigmoid output on a blank page: peak 1e-8, engines 2e-10 apart
    m = _m(2e-10, None)
    assert classify(m, a_float=False, b_float=False, reference_peak=1e-8) == "rounding"
    assert classify(_m(0.3, None), a_float=False, b_float=False, reference_peak=1.0) == (
        "divergence"
    )
    got = classify(_m(0.3, None), a_float=False, b_float=False, reference_peak=1.0, carried=0.3)
    assert got == "rounding"


def test_an_engine_that_writes_inf_is_measured_not_a_crash():
    # PP-OCRv4 rec quantized by ORT's quantize_static: one engine's float tensor held inf, and
    # log10(signal / inf) raised "math domain error" out of compare
    a = np.array([1.0, 2.0, 3.0])
    m = tensor_metrics(a, np.array([1.0, np.inf, 3.0]), None)
    assert m["sqnr_db"] is None and m["max_abs"] == math.inf
    assert classify(m, a_float=False, b_float=False, reference_peak=3.0) == "divergence"
