"""The executor's fast convolution sums (``kernels._conv_sums``) against int64 sums.

The reference is ``kernels._linear.conv_sums`` in int64 (exact integers, im2col per group): the
fast layouts (NHWC patches, 1 x 1 products, depthwise multiply-adds) and the float32 / float64
choice must not change one sum, including at the float32 limit, where every product is at its
largest so that a sum reaches the accumulator bound itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantbridge.integer.kernels._conv_sums import conv2d_sums, sum_dtype
from quantbridge.integer.kernels._linear import conv_sums


def _reference(x, xz, w, wz, strides, pads, dilations, group) -> np.ndarray:
    xc = x.astype(np.int64) - xz
    wc = w.astype(np.int64) - np.asarray(wz, np.int64).reshape(-1, 1, 1, 1)
    return conv_sums(xc, wc, strides, pads, dilations, group)


def _bound(x, xz, w, wz) -> float:
    code_range = max(255 - xz, xz) if x.dtype == np.uint8 else 128 + abs(xz)
    wc = np.abs(w.astype(np.int64) - np.asarray(wz, np.int64).reshape(-1, 1, 1, 1))
    return float(code_range * wc.sum(axis=(1, 2, 3)).max())


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    channels=st.sampled_from([1, 3, 8]),
    out=st.sampled_from([1, 4, 8]),
    kernel=st.sampled_from([(1, 1), (3, 3), (1, 3), (5, 2)]),
    stride=st.sampled_from([(1, 1), (2, 2), (2, 1)]),
    pad=st.sampled_from([(0, 0, 0, 0), (1, 1, 1, 1), (0, 2, 1, 0)]),
    dilation=st.sampled_from([(1, 1), (2, 1)]),
    depthwise=st.booleans(),
    signed=st.booleans(),
)
def test_fast_sums_equal_int64_sums(
    seed, channels, out, kernel, stride, pad, dilation, depthwise, signed
):
    rng = np.random.default_rng(seed)
    group, out = (channels, channels) if depthwise else (1, out)
    dtype = np.int8 if signed else np.uint8
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max + 1, (2, channels, 9, 11)).astype(dtype)
    xz = int(rng.integers(info.min, info.max + 1))
    w = rng.integers(-128, 128, (out, channels // group, *kernel)).astype(np.int8)
    wz = rng.integers(-3, 4, out)
    args = (stride, pad, dilation, group)
    got = conv2d_sums(x, xz, w, wz, *args, _bound(x, xz, w, wz))
    assert got is not None  # group 1 and depthwise always take the fast path
    np.testing.assert_array_equal(got.astype(np.int64), _reference(x, xz, w, wz, *args))


@pytest.mark.parametrize(("m", "dtype"), [(65793, np.float32), (65795, np.float64)])
def test_float32_limit_is_exact(m, dtype):
    """Inputs all 255, weights summing to ``m``: the one sum is ``255 m``, the bound itself.
    2**24 - 1 (m = 65793) runs in float32; 255 * 65795 = 2**24 + 509 is odd, which float32
    cannot hold, so it must not be one float32 sum (float32 chunks, added in float64)."""
    taps, rest = divmod(m, 127)
    w = np.full((1, taps + 1, 1, 1), 127, np.int8)
    w[0, -1] = rest
    x = np.full((1, taps + 1, 1, 1), 255, np.uint8)
    bound = float(255 * m)
    assert sum_dtype(bound) is dtype
    got = conv2d_sums(x, 0, w, np.zeros(1, np.int64), (1, 1), (0, 0, 0, 0), (1, 1), 1, bound)
    assert got.dtype == dtype and int(got.reshape(())) == 255 * m


@pytest.mark.parametrize(("channels", "signed", "kernel"), [(256, False, 3), (128, True, 3),
                                                            (1024, False, 1)])  # fmt: skip
def test_wide_sums_in_float32_chunks_are_exact(channels, signed, kernel):
    """Bounds beyond 2**24 (deep layers): float32 products over chunks of the reduction, each
    below 2**24, added in float64; equal to int64 sums, and the chunks respect the bound."""
    from quantbridge.integer.kernels._conv_sums import chunks

    rng = np.random.default_rng(channels)
    dtype = np.int8 if signed else np.uint8
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max + 1, (2, channels, 5, 6)).astype(dtype)
    x[0, :, :3] = info.max  # saturated regions: sums near the bound
    xz = -5 if signed else 7
    w = rng.integers(-128, 128, (16, channels, kernel, kernel)).astype(np.int8)
    w[0] = 127
    wz = np.zeros(16, np.int64)
    bound = _bound(x, xz, w, wz)
    assert bound >= 2**24
    pad = (kernel // 2,) * 4
    got = conv2d_sums(x, xz, w, wz, (1, 1), pad, (1, 1), 1, bound)
    ref = _reference(x, xz, w, wz, (1, 1), pad, (1, 1), 1)
    np.testing.assert_array_equal(got.astype(np.int64), ref)
    wk = np.abs(w.astype(np.int64).transpose(0, 2, 3, 1).reshape(16, -1))
    code_range = max(info.max - xz, xz - info.min)
    splits = chunks(wk.astype(np.float32), code_range)
    assert len(splits) > 1 and splits[-1][1] == wk.shape[1]
    assert all(code_range * wk[:, a:b].sum(axis=1).max() < 2**24 for a, b in splits)


def test_prepared_weights_do_not_outlive_their_array():
    """The executor caches centered weights (and their chunks) per weight array; a program that
    is gone must not keep them (tests and services lower many programs in one process)."""
    import gc

    from quantbridge.integer.kernels import _conv_sums

    rng = np.random.default_rng(0)
    w = rng.integers(-128, 128, (16, 256, 3, 3)).astype(np.int8)
    x = rng.integers(0, 256, (1, 256, 5, 5)).astype(np.uint8)
    # earlier tests' programs die in the cycle collector at arbitrary moments and drop their
    # entries: collect them first and keep the collector off while counting (regression: this
    # count failed once in the whole suite)
    gc.collect()
    gc.disable()
    try:
        before = len(_conv_sums._CACHE)
        args = (x, 3, w, np.zeros(16, np.int64), (1, 1), (1, 1, 1, 1), (1, 1), 1, 4e7)
        np.testing.assert_array_equal(conv2d_sums(*args), conv2d_sums(*args))  # the cached path
        assert len(_conv_sums._CACHE) == before + 2  # weights, chunks
        del args, w
        assert len(_conv_sums._CACHE) == before  # reference counting alone frees them
    finally:
        gc.enable()
