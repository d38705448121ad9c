"""mean_minmax: the mean over samples (items along axis 0) of per-sample extrema (NNCF's
MEAN_MINMAX), streaming, merge of halves, per channel."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quantbridge.calibrate import make_observer
from quantbridge.numerics import PerChannel

finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)
# batches of shape (N, 3, k): N samples each, 3 channels on axis 1
batches = st.lists(
    hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 4), st.just(3), st.integers(1, 5)),
        elements=finite,
    ),
    min_size=2,
    max_size=6,
)
# float64 sums of <= 24 values of magnitude <= 1e6, added in another order: relative error
# below 24 * 2**-52 ~ 5e-15 of the summed magnitudes (hence atol 1e-6 on 1e6-sized values)
TOL = {"rtol": 1e-12, "atol": 1e-6}


def _reference(chunks, channel_axis=None):
    """Independent: the float64 mean over every sample of every batch of its extrema."""
    samples = [s.astype(np.float64) for c in chunks for s in c]
    if channel_axis is None:
        return np.mean([s.min() for s in samples]), np.mean([s.max() for s in samples])
    # sample s has shape (3, k): channel axis 0 of the sample (axis 1 of the batch)
    return (
        np.mean([s.min(axis=1) for s in samples], axis=0),
        np.mean([s.max(axis=1) for s in samples], axis=0),
    )


@settings(max_examples=40, deadline=None)
@given(batches)
def test_mean_minmax_is_the_mean_of_per_sample_extrema(chunks) -> None:
    obs = make_observer("mean_minmax")
    for c in chunks:
        obs.update(c)
    lo, hi = obs.range()
    ref_lo, ref_hi = _reference(chunks)
    assert lo.shape == hi.shape == ()
    np.testing.assert_allclose([lo, hi], [ref_lo, ref_hi], **TOL)


@settings(max_examples=40, deadline=None)
@given(batches, st.sampled_from([None, 1, -2]))
def test_mean_minmax_streaming_equals_merge_of_halves(chunks, axis) -> None:
    gran = PerChannel(axis) if axis is not None else None
    whole, a, b = (make_observer("mean_minmax", gran) for _ in range(3))
    half = len(chunks) // 2
    for i, c in enumerate(chunks):
        whole.update(c)
        (a if i < half else b).update(c)
    a.merge(b.state_dict())
    np.testing.assert_allclose(a.range(), whole.range(), **TOL)
    assert a.values_seen == whole.values_seen
    assert a.state_dict()["samples"] == whole.state_dict()["samples"]
    ref = _reference(chunks, axis)
    np.testing.assert_allclose(whole.range(), ref, **TOL)


def test_mean_minmax_does_not_grow_with_one_outlier_sample() -> None:
    """Nine samples in [-1, 1] and one reaching 100: minmax's hi is 100, the mean's 10.9."""
    x = np.tile(np.array([-1.0, 1.0], dtype=np.float32), (10, 1))
    x[3, 1] = 100.0
    obs = make_observer("mean_minmax")
    obs.update(x[:4])
    obs.update(x[4:])
    lo, hi = obs.range()
    assert lo == -1.0 and hi == pytest.approx((9 * 1.0 + 100.0) / 10, rel=1e-15)


def test_mean_minmax_channel_axis_0_counts_the_batch_as_one_sample() -> None:
    obs = make_observer("mean_minmax", PerChannel(0))
    obs.update(np.array([[0.0, 2.0], [-4.0, 4.0]], dtype=np.float32))
    obs.update(np.array([[-2.0, 0.0], [0.0, 2.0]], dtype=np.float32))
    lo, hi = obs.range()
    np.testing.assert_array_equal(lo, [-1.0, -2.0])
    np.testing.assert_array_equal(hi, [1.0, 3.0])


def test_mean_minmax_state_dict_round_trip() -> None:
    obs = make_observer("mean_minmax")
    obs.update(np.array([[1.0, 3.0], [-2.0, 0.5]], dtype=np.float32))
    copy = make_observer("mean_minmax")
    copy.load_state_dict(obs.state_dict())
    np.testing.assert_array_equal(copy.range(), obs.range())
    copy.update(np.array([[0.0, 1.0]], dtype=np.float32))
    np.testing.assert_allclose(copy.range(), ((1.0 - 2.0 + 0.0) / 3, (3.0 + 0.5 + 1.0) / 3))
