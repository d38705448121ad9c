"""Percentile observer: within one bin width of np.percentile, exact merges."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quantbridge.calibrate import make_observer


@pytest.mark.parametrize("data", ["gaussian", "laplacian", "heavy_tailed"])
@pytest.mark.parametrize("percentile", [99.99, 99.9, 99.0, 90.0, 50.0])
def test_within_one_bin_width_of_numpy(request, data: str, percentile: float) -> None:
    x = request.getfixturevalue(data)
    obs = make_observer("percentile", percentile=percentile)
    for batch in np.array_split(x, 7):
        obs.update(batch)
    lo, hi = obs.range()
    width = obs.histogram.bin_width  # tolerance: one bin, 2R / 8192
    assert abs(hi - np.percentile(x, percentile)) < width
    assert abs(lo - np.percentile(x, 100 - percentile)) < width


@settings(max_examples=150, deadline=None)
@given(
    hnp.arrays(np.float32, st.integers(1, 60), elements=st.floats(-1000, 1000, width=32)),
    st.floats(50, 100),
    st.sampled_from([4, 16, 256]),
)
def test_within_one_bin_width_on_small_gappy_data(x: np.ndarray, p: float, num_bins: int) -> None:
    obs = make_observer("percentile", percentile=p, num_bins=num_bins)
    obs.update(x)
    lo, hi = obs.range()
    width = obs.histogram.bin_width
    xs = x.astype(np.float64)
    assert abs(hi - np.percentile(xs, p)) <= width * (1 + 1e-9)
    assert abs(lo - np.percentile(xs, 100 - p)) <= width * (1 + 1e-9)
    assert x.min() <= lo <= hi <= x.max()


def test_interpolation_between_equal_values_stays_on_them() -> None:
    """Regression (hypothesis found it): (1 - g) * 3 + g * 3 rounded to 2.9999999999999996, below
    the data's minimum."""
    obs = make_observer("percentile", percentile=99.0, num_bins=4)
    obs.update(np.array([3.0, 3.0], dtype=np.float32))
    assert obs.range() == (3.0, 3.0)


def test_percentile_100_is_minmax_exactly(heavy_tailed: np.ndarray) -> None:
    obs = make_observer("percentile", percentile=100)
    obs.update(heavy_tailed)
    assert obs.range() == (heavy_tailed.min(), heavy_tailed.max())


def test_merge_gives_the_identical_range(laplacian: np.ndarray) -> None:
    whole, a, b = (make_observer("percentile", percentile=99.9) for _ in range(3))
    whole.update(laplacian)
    a.update(laplacian[:123_457] * 1.0)
    b.update(laplacian[123_457:])
    b.merge(a)
    assert b.range() == whole.range()
    np.testing.assert_array_equal(b.histogram.counts, whole.histogram.counts)


def test_all_zero_data(gaussian: np.ndarray) -> None:
    obs = make_observer("percentile")
    obs.update(np.zeros(100, np.float32))
    assert obs.range() == (0.0, 0.0)
