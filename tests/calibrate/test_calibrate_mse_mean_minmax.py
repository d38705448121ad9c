"""mse_mean_minmax: the mse range widened to the mean of the batch extrema; streaming, merge of
halves, state dicts, and the cases where each term decides."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quantbridge.calibrate import make_observer
from quantbridge.numerics import QScheme

UINT8 = QScheme(signed=False, symmetric=False)  # the default preset's activation scheme
SCHEMES = (UINT8, QScheme(), QScheme(bits=4, signed=False, symmetric=False))
finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)
batches = st.lists(
    hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 40)), elements=finite),
    min_size=1,
    max_size=6,
)
# the floor is a float64 mean of <= 6 extrema of magnitude <= 1e4, summed in another order than
# the reference: relative error below 6 * 2**-52 of the summed magnitudes (atol 1e-9 on 1e4)
TOL = {"rtol": 1e-12, "atol": 1e-9}
BINS = 1024  # the histogram's resolution does not change what is tested; 8192 is 8x slower


def _reference(chunks, scheme):
    """Independent of the observer: the mse range of the same data (``mse`` has its own tests
    against brute force on the data), and the float64 mean of the batch extrema by numpy."""
    mse = make_observer("mse", num_bins=BINS)
    for c in chunks:
        mse.update(c)
    lo, hi = mse.range(scheme)
    b = [c.astype(np.float64) for c in chunks]
    return min(lo, np.mean([x.min() for x in b])), max(hi, np.mean([x.max() for x in b]))


@settings(max_examples=15, deadline=None)
@given(batches, st.sampled_from(SCHEMES))
def test_range_is_mse_widened_to_mean_of_batch_extrema(chunks, scheme) -> None:
    obs = make_observer("mse_mean_minmax", num_bins=BINS)
    for c in chunks:
        obs.update(c)
    lo, hi = obs.range(scheme)
    np.testing.assert_allclose([lo, hi], _reference(chunks, scheme), **TOL)
    # always inside the running extrema
    everything = np.concatenate([c.ravel() for c in chunks]).astype(np.float64)
    assert everything.min() <= lo <= hi <= everything.max()


@settings(max_examples=15, deadline=None)
@given(batches.filter(lambda b: len(b) >= 2))
def test_streaming_equals_merge_of_halves(chunks) -> None:
    whole, a, b = (make_observer("mse_mean_minmax", num_bins=BINS) for _ in range(3))
    half = len(chunks) // 2
    for i, c in enumerate(chunks):
        whole.update(c)
        (a if i < half else b).update(c)
    a.merge(b.state_dict())
    assert a.values_seen == whole.values_seen
    np.testing.assert_array_equal(a.histogram.counts, whole.histogram.counts)  # exact re-binning
    np.testing.assert_allclose(a.range(UINT8), whole.range(UINT8), **TOL)


def test_floor_decides_when_mse_clips_every_batch_peak() -> None:
    """Each batch: 100000 values in [0, 1) and one peak at 40. MSE (uint8) clips the peaks to
    about 35; the floor keeps the mean batch peak, 40 (as minmax and mean_minmax would)."""
    rng = np.random.default_rng(0)
    obs, mse = make_observer("mse_mean_minmax", num_bins=BINS), make_observer("mse", num_bins=BINS)
    for _ in range(4):
        x = np.append(rng.random(100_000), 40.0).astype(np.float32)
        obs.update(x)
        mse.update(x)
    assert mse.range(UINT8)[1] < 39.0
    lo, hi = obs.range(UINT8)
    assert hi == 40.0 and lo == mse.range(UINT8)[0]


def test_mse_decides_when_it_keeps_more_than_the_mean_peak() -> None:
    """Uniform batches, one of them reaching 4: MSE keeps that batch's values (clipping them
    costs more than the wider grid), wider than the mean batch maximum, 1.6."""
    rng = np.random.default_rng(1)
    obs, mse = make_observer("mse_mean_minmax", num_bins=BINS), make_observer("mse", num_bins=BINS)
    for i in range(5):
        x = rng.uniform(-1.0, 4.0 if i == 2 else 1.0, 20_000).astype(np.float32)
        obs.update(x)
        mse.update(x)
    assert mse.range(UINT8)[1] > 3.0
    np.testing.assert_array_equal(obs.range(UINT8), mse.range(UINT8))


def test_state_dict_round_trip_and_needs_scheme() -> None:
    obs = make_observer("mse_mean_minmax", num_bins=BINS)
    obs.update(np.array([[1.0, 3.0, 0.5]], dtype=np.float32))
    obs.update(np.array([[-2.0, 0.5, 0.25]], dtype=np.float32))
    copy = make_observer("mse_mean_minmax", num_bins=BINS)
    copy.load_state_dict(obs.state_dict())
    np.testing.assert_array_equal(copy.range(UINT8), obs.range(UINT8))
    assert copy.state_dict()["batches"] == 2
    assert not obs.tensor_merge
    with pytest.raises(ValueError, match="needs the quantization scheme"):
        obs.range()
