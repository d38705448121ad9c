"""Conv (1-D, 2-D, 3-D), ConvTranspose and MatMul kernels: int8 x int8 sums, + int32 bias, one requantize.

Real arithmetic: ``r_x = s_x (q_x - z_x)``, ``r_w = s_w[c] (q_w - z_w[c])``, bias
``r_b = s_x s_w[c] q_b`` (zero point 0), output ``r_y = s_y (q_y - z_y)``. Integer pipeline:

    acc[c] = sum_k (q_x - z_x) (q_w[c, k] - z_w[c]) + q_b[c]            (exact integer)
    q_y    = clip(z_y + round_half_even(acc[c] * M[c] / 2**n[c]), qmin, qmax)
    with M[c] / 2**n[c] ~= s_x s_w[c] / s_y                              (numerics.requantize)

Accumulator bound (checked at lowering, ``lowering._linear``): ``|acc[c]| <= max|q_x - z_x| *
sum_k |q_w[c, k] - z_w[c]| + |q_b[c]|``; below 2**31 for an int32 accumulator. The sums run as
float32 / float64 matrix products (BLAS), exact while the bound is below 2**24 / 2**53
(``_conv_sums``, the fast layouts of Conv); wider ones use int64.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ...numerics import requantize
from ._conv_sums import conv2d_sums
from ._registry import register_kernel

EXACT_FLOAT64 = 2**53


def _sum_dtype(attrs) -> type:
    return np.float64 if attrs["bound"] < EXACT_FLOAT64 else np.int64


def _finish(attrs, acc: np.ndarray, channel_axis: int) -> np.ndarray:
    """``+ bias``, requantize per output channel, cast: the shared tail of every kernel here."""
    shape = [1] * acc.ndim
    shape[channel_axis] = -1
    acc = acc.astype(np.int64, copy=False)  # float sums hold exact integers (``_conv_sums``)
    acc = acc + np.asarray(attrs["bias"], np.int64).reshape(shape)
    m = np.asarray(attrs["multiplier"]).reshape(shape)
    n = np.asarray(attrs["shift"]).reshape(shape)
    y = requantize(acc, m, n, attrs["out_zero"], attrs["qmin"], attrs["qmax"])
    return y.astype(attrs["dtype"])


def _centered(q: np.ndarray, zero: object, dtype: type, shape: tuple[int, ...] = ()) -> np.ndarray:
    zero = np.asarray(zero, np.int64)
    if zero.ndim and shape:
        zero = zero.reshape(shape)
    return (q.astype(np.int64) - zero).astype(dtype)


def conv_sums(x, w, strides, pads, dilations, group) -> np.ndarray:
    """``sum_k x * w`` of an N-D convolution (N, C, *S) x (O, C/group, *K), any dtype (im2col
    per group: the windows of each output position times the weight matrix)."""
    n, o, cg, ks = x.shape[0], w.shape[0], w.shape[1], w.shape[2:]
    rank = len(ks)
    x = np.pad(x, ((0, 0), (0, 0), *((pads[i], pads[i + rank]) for i in range(rank))))
    spans = tuple((k - 1) * d + 1 for k, d in zip(ks, dilations, strict=True))
    win = sliding_window_view(x, spans, axis=tuple(range(2, 2 + rank)))
    win = win[(slice(None), slice(None), *(slice(None, None, s) for s in strides),
               *(slice(None, None, d) for d in dilations))]  # N, C, *OUT, *K  # fmt: skip
    outs = win.shape[2 : 2 + rank]
    win = win.reshape(n, group, cg, *outs, *ks)  # -> N, G, *OUT, C/G, *K
    win = win.transpose(0, 1, *range(3, 3 + rank), 2, *range(3 + rank, 3 + 2 * rank))
    cols = win.reshape(n, group, int(np.prod(outs)), cg * int(np.prod(ks)))
    wm = w.reshape(group, o // group, -1).transpose(0, 2, 1)
    out = np.matmul(cols, wm)  # N, G, prod(OUT), O/G
    return out.transpose(0, 1, 3, 2).reshape(n, o, *outs)


def _as_2d(x: np.ndarray, w: np.ndarray, attrs) -> tuple:
    """1-D convolutions run as 2-D ones with a unit height (codes or centered values); 2-D and
    3-D ones as they are."""
    if x.ndim != 3:
        return x, w, attrs["strides"], attrs["pads"], attrs["dilations"]
    (s,), (d,), (p0, p1) = attrs["strides"], attrs["dilations"], attrs["pads"]
    return x[:, :, None], w[:, :, None], (1, s), (0, p0, 0, p1), (1, d)


@register_kernel("conv")
def conv(attrs, x: np.ndarray) -> np.ndarray:
    x2, w2, strides, pads, dilations = _as_2d(x, attrs["weight"], attrs)
    acc = None
    if x2.ndim == 4:  # the fast layouts of 2-D convolutions
        acc = conv2d_sums(x2, attrs["x_zero"], w2, attrs["w_zero"], strides, pads, dilations,
                          attrs["group"], attrs["bound"])  # fmt: skip
    if acc is None:  # 3-D, grouped (not depthwise) or int64 sums: im2col per group
        dtype = _sum_dtype(attrs)
        xc = _centered(x2, attrs["x_zero"], dtype)
        wc = _centered(w2, attrs["w_zero"], dtype, (-1,) + (1,) * (w2.ndim - 1))
        acc = conv_sums(xc, wc, strides, pads, dilations, attrs["group"])
    return _finish(attrs, acc.reshape(acc.shape[:2] + acc.shape[-(x.ndim - 2) :]), 1)


def conv_transpose_sums(x, w, strides, pads, dilations, group, output_padding) -> np.ndarray:
    """``sum`` of a 2-D transposed convolution (N, C, H, W) x (C, O/group, KH, KW)."""
    n, c, h, wd = x.shape
    _, og, kh, kw = w.shape
    (sh, sw), (dh, dw) = strides, dilations
    full_h = sh * (h - 1) + output_padding[0] + (kh - 1) * dh + 1
    full_w = sw * (wd - 1) + output_padding[1] + (kw - 1) * dw + 1
    out = np.zeros((n, group * og, full_h, full_w), dtype=x.dtype)
    cg = c // group
    for g in range(group):
        xg = x[:, g * cg : (g + 1) * cg].reshape(n, cg, h * wd).transpose(0, 2, 1)
        cols = np.matmul(xg, w[g * cg : (g + 1) * cg].reshape(cg, og * kh * kw))
        cols = cols.reshape(n, h, wd, og, kh, kw).transpose(0, 3, 4, 5, 1, 2)
        for i in range(kh):
            for j in range(kw):
                rows = slice(i * dh, i * dh + (h - 1) * sh + 1, sh)
                colz = slice(j * dw, j * dw + (wd - 1) * sw + 1, sw)
                out[:, g * og : (g + 1) * og, rows, colz] += cols[:, :, i, j]
    return out[:, :, pads[0] : full_h - pads[2], pads[1] : full_w - pads[3]]


@register_kernel("conv_transpose")
def conv_transpose(attrs, x: np.ndarray) -> np.ndarray:
    dtype = _sum_dtype(attrs)
    xc = _centered(x, attrs["x_zero"], dtype)
    w, group = attrs["weight"], attrs["group"]  # w_zero is per output channel g * O/group + o
    grouped = w.astype(np.int64).reshape(group, w.shape[0] // group, *w.shape[1:])
    zero = np.asarray(attrs["w_zero"], np.int64).reshape(group, 1, -1, 1, 1)
    wc = (grouped - zero).reshape(w.shape).astype(dtype)
    acc = conv_transpose_sums(
        xc,
        wc,
        attrs["strides"],
        attrs["pads"],
        attrs["dilations"],
        attrs["group"],
        attrs["output_padding"],
    )
    return _finish(attrs, acc, 1)


@register_kernel("matmul")
def matmul(attrs, a: np.ndarray, *b: np.ndarray) -> np.ndarray:
    """``a @ w`` with a constant (K, N) weight (per-column zero point), or ``a @ b`` of two
    activations (scalar zero points), + bias, requantized along the last axis."""
    dtype = _sum_dtype(attrs)
    ac = _centered(a, attrs["a_zero"], dtype)
    bc = _centered(b[0] if b else attrs["weight"], attrs["b_zero"], dtype, (1, -1))
    acc = np.matmul(ac, bc) if dtype is np.float64 else np.einsum("...ik,...kj->...ij", ac, bc)
    return _finish(attrs, acc, acc.ndim - 1)
