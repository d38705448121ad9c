"""The model-level metrics of ``sensitivity``, against closed forms (properties, hypothesis)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantbridge as qb
from quantbridge.debug._sens_metrics import (
    Outputs,
    check_budget,
    mean_cosine,
    metric_fn,
    sqnr_db,
    top1,
)


def _outs(*batches) -> Outputs:
    return Outputs(flat=[np.asarray(b, dtype=np.float64) for b in batches])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    eps=st.floats(1e-6, 0.5),
    split=st.integers(1, 7),
)
def test_sqnr_of_a_relative_error_is_its_decibels(seed, eps, split):
    # out = ref * (1 + eps): noise power = eps^2 * signal power -> SQNR = -20 log10(eps) exactly,
    # however the samples are split into batches
    ref = np.random.default_rng(seed).normal(size=(8, 5))
    got = sqnr_db(
        _outs(ref[:split], ref[split:]), _outs(ref[:split] * (1 + eps), ref[split:] * (1 + eps))
    )
    assert got == pytest.approx(-20 * math.log10(eps), abs=1e-6)
    assert sqnr_db(_outs(ref), _outs(ref)) == math.inf


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.01, 100.0))
def test_cosine_is_one_for_a_scaled_copy_and_the_mean_over_samples(seed, scale):
    rng = np.random.default_rng(seed)
    ref = rng.normal(size=(6, 4))
    assert mean_cosine(_outs(ref), _outs(ref * scale)) == pytest.approx(1.0, abs=1e-12)
    assert mean_cosine(_outs(ref), _outs(-ref)) == pytest.approx(-1.0, abs=1e-12)
    # one sample orthogonal, one identical: the mean is 0.5
    a = np.array([[1.0, 0.0], [0.0, 2.0]])
    b = np.array([[0.0, 3.0], [0.0, 1.0]])
    assert mean_cosine(_outs(a), _outs(b)) == pytest.approx(0.5)


def test_top1_against_labels_and_against_float():
    ref = Outputs(logits=[np.array([[0.0, 1.0], [2.0, 0.0], [0.0, 5.0]])])
    out = Outputs(logits=[np.array([[0.0, 1.0], [0.0, 2.0], [0.0, 5.0]])])
    assert top1(ref, out) == pytest.approx(2 / 3)  # sample 1 flipped against float
    assert top1(ref, out, np.array([0, 1, 0])) == pytest.approx(1 / 3)  # predicted 1, 1, 1
    with pytest.raises(ValueError, match="2 labels for 3"):
        top1(ref, out, np.array([1, 1]))


def test_unknown_metric_names_the_known_ones():
    with pytest.raises(ValueError, match=r"\['cosine', 'sqnr', 'top1'\]"):
        metric_fn("psnr")


@pytest.mark.parametrize(
    ("metric", "budget", "hint"),
    [("cosine", 40.0, r"\[-1, 1\].*sqnr takes dB"), ("top1", 98.0, r"\[0, 1\].*0.98 for 98 %")],
)
def test_a_budget_the_metric_cannot_reach_is_refused(metric, budget, hint, capsys):
    # regression: `quantbridge sensitivity ... --budget 40` (cosine, the default metric) kept
    # every layer float and reported "achieved 1"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    data = [torch.randn(2, 4)]
    with pytest.raises(ValueError, match=rf"budget {budget:g} is outside what {metric}.*{hint}"):
        qb.sensitivity(model, data, data, metric=metric, budget=budget, progress=False)
    check_budget("sqnr", 40.0)  # dB: any number
    check_budget("cosine", 0.999)
