"""Pooling and reductions: MaxPool on codes, average pools and means as integer sums.

MaxPool: ``r = s(q - z)`` is increasing in ``q``, so ``max`` commutes with dequantization:
    q_y = max over the window of q_x (padding holds the type's minimum code); no rescale.
ReduceMax / ReduceMin: the same argument over ``axes`` (all of them when None): q_y = max
    (min) of q_x; no rescale, exact.
Average pool / GlobalAveragePool / ReduceMean:
    acc   = sum over the window of (q_x - z_x)          |acc| <= count * 2**8 (8-bit codes)
    q_y   = clip(z_y + round_half_even(acc * M / 2**n))   M / 2**n ~= s_x / (count * s_y)
    ``count`` may differ per output position (padding excluded): M and n are then arrays over
    the output's spatial positions.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ...numerics import requantize
from ._registry import register_kernel


def windows(x: np.ndarray, attrs, pad_value: int) -> np.ndarray:
    """(N, C, *OUT, *K) windows of a 2-D (or 3-D) pool, padding filled with ``pad_value``."""
    kernel, strides, dilations, pads = (attrs["kernel"], attrs["strides"], attrs["dilations"],
                                        attrs["pads"])  # fmt: skip
    rank = len(kernel)
    x = np.pad(
        x,
        ((0, 0), (0, 0), *((pads[i], pads[i + rank]) for i in range(rank))),
        constant_values=pad_value,
    )
    spans = tuple((k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True))
    win = sliding_window_view(x, spans, axis=tuple(range(2, 2 + rank)))
    return win[(slice(None), slice(None), *(slice(None, None, s) for s in strides),
                *(slice(None, None, d) for d in dilations))]  # fmt: skip


@register_kernel("maxpool")
def maxpool(attrs, x: np.ndarray) -> np.ndarray:
    pad = int(np.iinfo(x.dtype).min)
    win = windows(x, attrs, pad)
    taps = list(np.ndindex(*attrs["kernel"]))
    out = win[(..., *taps[0])].copy()
    for tap in taps[1:]:  # one elementwise max per window position (fast strides)
        np.maximum(out, win[(..., *tap)], out=out)
    return out


@register_kernel("reduce_max")
def reduce_max(attrs, x: np.ndarray) -> np.ndarray:
    return np.asarray(np.max(x, axis=attrs["axes"], keepdims=attrs["keepdims"]), x.dtype)


@register_kernel("reduce_min")
def reduce_min(attrs, x: np.ndarray) -> np.ndarray:
    return np.asarray(np.min(x, axis=attrs["axes"], keepdims=attrs["keepdims"]), x.dtype)


@register_kernel("avgpool")
def avgpool(attrs, x: np.ndarray) -> np.ndarray:
    centered = x.astype(np.int64) - np.int64(attrs["x_zero"])
    acc = windows(centered, attrs, 0).sum(axis=(-2, -1))
    y = requantize(
        acc, attrs["multiplier"], attrs["shift"], attrs["out_zero"], attrs["qmin"], attrs["qmax"]
    )
    return y.astype(attrs["dtype"])


@register_kernel("reduce_mean")
def reduce_mean(attrs, x: np.ndarray) -> np.ndarray:
    centered = x.astype(np.int64) - np.int64(attrs["x_zero"])
    acc = centered.sum(axis=tuple(attrs["axes"]), keepdims=attrs["keepdims"])
    y = requantize(
        acc, attrs["multiplier"], attrs["shift"], attrs["out_zero"], attrs["qmin"], attrs["qmax"]
    )
    return y.astype(attrs["dtype"])


@register_kernel("resize_linear")
def resize_linear(attrs, x: np.ndarray) -> np.ndarray:
    """Linear Resize: along each resized axis ``(axis, i0, i1, w1)``,
    ``acc = acc[i0] (2**F - w1) + acc[i1] w1`` on centered codes (exact in int64; ``K`` axes
    scale it by ``2**(K F)``), then one requantization (``lowering._resize``)."""
    acc = x.astype(np.int64) - np.int64(attrs["x_zero"])
    one = np.int64(1) << attrs["frac"]
    for axis, i0, i1, w1 in attrs["axes"]:
        shape = [1] * acc.ndim
        shape[axis] = -1
        w = np.asarray(w1, np.int64).reshape(shape)
        acc = np.take(acc, i0, axis=axis) * (one - w) + np.take(acc, i1, axis=axis) * w
    y = requantize(acc, attrs["multiplier"], attrs["shift"], attrs["out_zero"], attrs["qmin"],
                   attrs["qmax"])  # fmt: skip
    return y.astype(attrs["dtype"])


@register_kernel("resize_cubic")
def resize_cubic(attrs, x: np.ndarray) -> np.ndarray:
    """Cubic Resize: along each resized axis ``(axis, taps, weights)`` (both ``(n_out, 4)``:
    source indices clamped to the axis, integer weights summing to ``2**F``), ``acc[o] =
    sum_t acc[taps[o, t]] weights[o, t]`` on centered codes (exact in int64; ``K`` axes scale it
    by ``2**(K F)``), then one requantization (``lowering._resize``)."""
    acc = x.astype(np.int64) - np.int64(attrs["x_zero"])
    for axis, taps, weights in attrs["axes"]:
        shape = [1] * acc.ndim
        shape[axis] = -1
        taps, weights = np.asarray(taps, np.int64), np.asarray(weights, np.int64)
        acc = sum(np.take(acc, taps[:, t], axis=axis) * weights[:, t].reshape(shape)
                  for t in range(taps.shape[1]))  # fmt: skip
    y = requantize(acc, attrs["multiplier"], attrs["shift"], attrs["out_zero"], attrs["qmin"],
                   attrs["qmax"])  # fmt: skip
    return y.astype(attrs["dtype"])
