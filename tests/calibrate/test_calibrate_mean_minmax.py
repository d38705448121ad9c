"""mean_minmax: the mean over batches of the batch extrema (NNCF's MEAN_MINMAX), streaming, merge
of halves, per channel."""

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
# float64 sums of <= 6 values of magnitude <= 1e6, added in another order: relative error
# below 6 * 2**-52 ~ 1.3e-15 of the summed magnitudes (hence atol 1e-6 on 1e6-sized values)
TOL = {"rtol": 1e-12, "atol": 1e-6}


def _reference(chunks, channel_axis=None):
    """Independent: the float64 mean over the batches of their extrema."""
    batches = [c.astype(np.float64) for c in chunks]
    if channel_axis is None:
        return np.mean([b.min() for b in batches]), np.mean([b.max() for b in batches])
    # channels on axis 1 of each (N, 3, k) batch
    return (
        np.mean([b.min(axis=(0, 2)) for b in batches], axis=0),
        np.mean([b.max(axis=(0, 2)) for b in batches], axis=0),
    )


@settings(max_examples=40, deadline=None)
@given(batches)
def test_mean_minmax_is_the_mean_of_batch_extrema(chunks) -> None:
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
    assert a.state_dict()["batches"] == whole.state_dict()["batches"]
    ref = _reference(chunks, axis)
    np.testing.assert_allclose(whole.range(), ref, **TOL)


def test_mean_minmax_does_not_grow_with_one_outlier_batch() -> None:
    """Nine batches in [-1, 1] and one reaching 100: minmax's hi is 100, the mean's 10.9."""
    obs = make_observer("mean_minmax")
    for i in range(10):
        obs.update(np.array([[-1.0, 100.0 if i == 3 else 1.0]], dtype=np.float32))
    lo, hi = obs.range()
    assert lo == -1.0 and hi == pytest.approx((9 * 1.0 + 100.0) / 10, rel=1e-15)


def test_mean_minmax_reduces_each_batch_whole_not_per_sample() -> None:
    """NNCF (given a list of feeds) takes the extrema of a whole batch, not the mean of its items."""
    obs = make_observer("mean_minmax")
    obs.update(np.array([[0.0, 1.0], [-4.0, 0.0]], dtype=np.float32))
    lo, hi = obs.range()
    assert lo == -4.0 and hi == 1.0


def test_mean_minmax_state_dict_round_trip() -> None:
    obs = make_observer("mean_minmax")
    obs.update(np.array([[1.0, 3.0]], dtype=np.float32))
    obs.update(np.array([[-2.0, 0.5]], dtype=np.float32))
    copy = make_observer("mean_minmax")
    copy.load_state_dict(obs.state_dict())
    np.testing.assert_array_equal(copy.range(), obs.range())
    copy.update(np.array([[0.0, 1.0]], dtype=np.float32))
    np.testing.assert_allclose(copy.range(), ((1.0 - 2.0 + 0.0) / 3, (3.0 + 0.5 + 1.0) / 3))
