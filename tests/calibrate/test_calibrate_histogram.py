"""The power-of-two histogram: exact counts, exact re-binning, exact order-free merges."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quantbridge.calibrate import Histogram, make_observer
from quantbridge.calibrate._base import torch_view
from quantbridge.calibrate._histogram import halve_resolution, pow2_above


def reference_counts(data: np.ndarray, hist: Histogram) -> np.ndarray:
    """np.histogram in float64 over the histogram's final range ``[-R, R]``."""
    counts, _ = np.histogram(
        data.astype(np.float64), bins=hist.num_bins, range=(-hist.half_range, hist.half_range)
    )
    return counts


def fed(chunks: list[np.ndarray], num_bins: int = 64) -> Histogram:
    hist = Histogram(num_bins)
    for chunk in chunks:
        if chunk.size:
            hist.add(chunk, float(chunk.min()), float(chunk.max()))
    return hist


# values of very different magnitudes, so that R doubles many times between batches
magnitudes = st.floats(-(2.0**20), 2.0**20, allow_nan=False, width=32) | st.floats(
    -(2.0**-10), 2.0**-10, allow_nan=False, width=32
)
chunk = hnp.arrays(np.float32, st.integers(0, 40), elements=magnitudes)


@settings(max_examples=150, deadline=None)
@given(st.lists(chunk, min_size=1, max_size=6), st.sampled_from([2, 8, 64]))
def test_counts_equal_np_histogram_after_growth(chunks: list[np.ndarray], num_bins: int) -> None:
    data = np.concatenate(chunks)
    hist = fed(chunks, num_bins)
    assert hist.total == data.size
    if data.size == 0:
        return
    amax = float(np.abs(data).max())
    assert hist.half_range == pow2_above(amax)
    assert hist.min == data.min() and hist.max == data.max()
    if amax > 0:
        np.testing.assert_array_equal(hist.counts, reference_counts(data, hist))
    else:
        assert hist.counts[num_bins // 2] == data.size


@settings(max_examples=100, deadline=None)
@given(st.lists(chunk, min_size=2, max_size=6), st.randoms(use_true_random=False))
def test_merge_is_exact_and_order_independent(chunks: list[np.ndarray], rnd) -> None:
    whole = fed([np.concatenate(chunks)])
    parts = [fed([c]) for c in chunks]
    rnd.shuffle(parts)
    merged = Histogram(64)
    for part in parts:
        merged.merge(part)
    np.testing.assert_array_equal(merged.counts, whole.counts)
    assert (merged.half_range, merged.min, merged.max) == (whole.half_range, whole.min, whole.max)


def test_doubling_sums_adjacent_pairs() -> None:
    counts = np.arange(1, 9)  # N = 8 bins over [-R, R): old bin j -> new bin (4 + j) // 2
    np.testing.assert_array_equal(
        halve_resolution(counts), [0, 0, 1 + 2, 3 + 4, 5 + 6, 7 + 8, 0, 0]
    )


def test_default_8192_bins_on_real_sized_batches(laplacian: np.ndarray) -> None:
    obs = make_observer("percentile")
    for i, scale in enumerate([0.01, 1.0, 30.0]):  # R grows 0.06 -> 16 -> 512: many doublings
        obs.update(laplacian[i * 50_000 : (i + 1) * 50_000] * scale)
    data = np.concatenate(
        [laplacian[i * 50_000 : (i + 1) * 50_000] * s for i, s in enumerate([0.01, 1.0, 30.0])]
    )
    hist = obs.histogram
    assert hist.num_bins == 8192 and hist.half_range == pow2_above(float(np.abs(data).max()))
    np.testing.assert_array_equal(hist.counts, reference_counts(data, hist))


def test_values_on_bin_edges_and_tiny_negatives() -> None:
    hist = Histogram(8)  # R = 4 after the 3.0: edges -4, -3, ..., 4
    values = np.array([3.0, -3.0, -1.0, 0.0, -0.0, 1.0, -1e-30, 1e-30, -4.0 + 2**-40])
    hist.add(values, float(values.min()), float(values.max()))
    assert hist.half_range == 4.0
    np.testing.assert_array_equal(hist.counts, reference_counts(values, hist))
    # float64 input: -1e-300 underflows to -0.0 when scaled to bins of width 2**1000 / 4
    big = Histogram(8)
    values = np.array([2.0**1000, -1e-300, 1e-300])
    big.add(values, float(values.min()), float(values.max()))
    np.testing.assert_array_equal(big.counts, [0, 0, 0, 1, 1, 0, 1, 0])


def test_zeros_first_then_data() -> None:
    hist = fed([np.zeros(5, np.float32), np.array([0.75, -0.3], np.float32)], num_bins=4)
    assert hist.half_range == 1.0  # bins [-1, -.5), [-.5, 0), [0, .5), [.5, 1)
    np.testing.assert_array_equal(hist.counts, [0, 1, 5, 1])


@pytest.mark.parametrize("num_bins", [0, 1, 6, 100, 3.0, True])
def test_num_bins_must_be_a_power_of_two(num_bins) -> None:
    with pytest.raises((ValueError, TypeError), match="num_bins"):
        Histogram(num_bins)


def test_state_dict_round_trip_and_merge_via_state(laplacian: np.ndarray) -> None:
    a = make_observer("percentile", num_bins=1024)
    b = make_observer("percentile", num_bins=1024)
    a.update(laplacian[:1000])
    b.update(laplacian[1000:5000] * 100)
    state = b.state_dict()
    assert state["counts"].dtype == np.int64 and isinstance(state["half_range"], float)
    restored = make_observer("percentile", num_bins=1024)
    restored.load_state_dict(state)
    np.testing.assert_array_equal(restored.histogram.counts, b.histogram.counts)
    a.merge(state)
    whole = make_observer("percentile", num_bins=1024)
    whole.update(np.concatenate([laplacian[:1000], laplacian[1000:5000] * 100]))
    np.testing.assert_array_equal(a.histogram.counts, whole.histogram.counts)
    with pytest.raises(ValueError, match="num_bins"):
        make_observer("percentile", num_bins=2048).merge(state)
    with pytest.raises(ValueError, match="power of two"):
        restored.load_state_dict({**state, "half_range": 3.0})
    assert math.isclose(a.range()[1], whole.range()[1])


def test_all_reduce_recipe_is_exact(laplacian: np.ndarray) -> None:
    """The three-step all-reduce of the module docstring, done by hand over three 'ranks'."""
    parts = [laplacian[:1000] * 0.1, laplacian[1000:3000] * 5.0, laplacian[3000:4000]]
    ranks = [make_observer("entropy") for _ in parts]
    for obs, part in zip(ranks, parts, strict=True):
        obs.update(part)
    half_range = max(obs.histogram.half_range for obs in ranks)  # all-reduce MAX
    for obs in ranks:
        obs.histogram.grow_to(half_range)
    whole = make_observer("entropy")
    whole.update(np.concatenate(parts))
    total = sum(obs.histogram.counts for obs in ranks)  # all-reduce SUM
    np.testing.assert_array_equal(total, whole.histogram.counts)


# Large float batches are counted with torch's kernels (calibrate/_base.torch_view): the bins must
# be exactly those of the float64 numpy path, i.e. of np.histogram over [-R, R] in float64.
big_pool = hnp.arrays(np.float32, st.integers(1, 64), elements=magnitudes)


@settings(max_examples=60, deadline=None)
@given(big_pool, st.sampled_from([64, 2048, 8192]), st.integers(0, 2**32 - 1))
def test_torch_counting_equals_np_histogram(pool: np.ndarray, num_bins: int, seed: int) -> None:
    pytest.importorskip("torch")
    data = np.random.default_rng(seed).choice(pool, size=70_000)  # above the torch threshold
    assert torch_view(data) is not None  # the torch path is the one under test
    hist = fed([data], num_bins)
    np.testing.assert_array_equal(hist.counts, reference_counts(data, hist))


def test_torch_counting_float32_underflow_and_signed_zero() -> None:
    pytest.importorskip("torch")
    tiny = np.float32(1.4e-45)  # the smallest float32 subnormal
    # R = 2**21: bin width 2**9 with 8192 bins, so x / w underflows to -0.0 for -tiny
    edge = [2.0**21 - 1, -tiny, tiny, -0.0, 0.0, -512.0, 512.0, -(2.0**21) + 1, -1.0]
    data = np.resize(np.array(edge, dtype=np.float32), 70_000)
    hist = fed([data], 8192)
    np.testing.assert_array_equal(hist.counts, reference_counts(data, hist))
    wide = data.astype(np.float64)
    assert hist.counts[8192 // 2 - 1] == np.count_nonzero((wide >= -512.0) & (wide < 0.0))


def test_torch_extrema_propagate_nan_like_numpy() -> None:
    pytest.importorskip("torch")
    obs = make_observer("percentile")
    data = np.ones(70_000, dtype=np.float32)
    data[12_345] = np.nan
    with pytest.raises(ValueError, match="1 NaN"):
        obs.update(data)
    assert obs.values_seen == 0


@pytest.mark.parametrize("num_bins", [64, 8192, 1 << 16])  # int16 indices, and int32 above 2**15
@pytest.mark.parametrize("exact_offset_bins", [1 << 24, 32])  # 32: the int64 path of huge N
def test_torch_counting_in_slices_equals_np_histogram(monkeypatch, num_bins, exact_offset_bins):
    # a batch counted a slice at a time (the last one short) gives the counts of the whole
    pytest.importorskip("torch")
    from quantbridge.calibrate import _histogram

    monkeypatch.setattr(_histogram, "_SLICE", 4_099)
    monkeypatch.setattr(_histogram, "_EXACT_OFFSET_BINS", exact_offset_bins)
    tiny = np.float32(1.4e-45)
    rng = np.random.default_rng(num_bins)
    data = np.concatenate(
        [
            rng.laplace(0.0, 3.0, 70_000).astype(np.float32),
            np.resize(np.array([-tiny, tiny, -0.0, 0.0, -1.0], dtype=np.float32), 1_000),
        ]
    )
    hist = fed([data[:20_000], data[20_000:]], num_bins)
    np.testing.assert_array_equal(hist.counts, reference_counts(data, hist))
    wide = data.astype(np.float64) * 2.0**100  # float64, and x / w scales by 2**-k, k > 0
    hist = fed([wide], num_bins)
    np.testing.assert_array_equal(hist.counts, reference_counts(wide, hist))
