"""Fast exact sums of integer convolutions: ``sum_k (q_x - z_x) (q_w - z_w)`` as BLAS products.

The sums are integers; a floating-point matrix product computes them exactly when every partial
sum fits the mantissa, whatever order BLAS adds in: each partial sum is bounded by the layer's
accumulator bound ``max|q_x - z_x| * sum_k |q_w - z_w|`` (``lowering._linear``), so float32 is
exact below 2**24 and float64 below 2**53 (``sum_dtype``). The layout only changes speed:

* sums beyond 2**24 (``group == 1``): float32 products over chunks of the reduction axis, each
  chunk's bound below 2**24 (``chunks``, from the weights and the input's code range), added
  in float64; float32 BLAS is about twice as fast as float64 here;
* ``group == 1``: the input goes to NHWC once, the patches are copied with the channels
  innermost (contiguous runs) into ``cols`` (P, KH*KW*C), and one product ``W @ cols.T`` gives
  (O, P), already NCHW; a 1 x 1 convolution with no padding skips the patch copy;
* depthwise (one input and one output channel per group): KH*KW multiply-adds of shifted views;
* other groups: ``_linear.conv_sums`` (im2col per group).

The centered weights (in their sum dtype and layout) and their chunks are kept per weight array
while it lives (``_prepared``, ``_ref``), since the same program runs many times.
"""

from __future__ import annotations

import weakref

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

EXACT_FLOAT32 = 2**24
EXACT_FLOAT64 = 2**53
_CACHE: dict[tuple, tuple[weakref.ref, np.ndarray]] = {}


def sum_dtype(bound: float) -> type:
    """The narrowest type whose additions of integers below ``bound`` are exact."""
    if bound < EXACT_FLOAT32:
        return np.float32
    return np.float64 if bound < EXACT_FLOAT64 else np.int64


def centered(q: np.ndarray, zero: object, dtype: type) -> np.ndarray:
    """``q - zero`` in ``dtype`` (exact: codes and zero points are small integers)."""
    return np.subtract(q, np.asarray(zero, np.int64).astype(dtype), dtype=dtype)


def _prepared(w: np.ndarray, zero: object, dtype: type, layout: str) -> np.ndarray:
    """Centered weights (O, C, KH, KW) in ``dtype``: ``"okkc"`` (O, KH*KW*C) for the patch
    product, ``"oc"`` for 1 x 1, ``"ckk"`` (C, KH, KW) for depthwise; cached per array."""
    z = np.asarray(zero, np.int64)
    key = (id(w), layout, np.dtype(dtype).str, z.tobytes())
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is w:
        return hit[1]
    wc = centered(w, z.reshape(-1, *([1] * (w.ndim - 1))) if z.ndim else z, dtype)
    if layout == "okkc":
        wc = np.ascontiguousarray(wc.transpose(0, 2, 3, 1).reshape(w.shape[0], -1))
    elif layout == "oc":
        wc = np.ascontiguousarray(wc.reshape(w.shape[0], w.shape[1]))
    else:
        wc = np.ascontiguousarray(wc[:, 0])
    _CACHE[key] = (_ref(w, key), wc)
    return wc


def _ref(array: np.ndarray, key: tuple) -> weakref.ref:
    """A weak reference whose death drops the cache entry (no prepared weights outlive their
    program)."""
    return weakref.ref(array, lambda _, k=key: _CACHE.pop(k, None))


def _code_range(x: np.ndarray, zero: object) -> int:
    info, z = np.iinfo(x.dtype), int(np.asarray(zero).reshape(()))
    return max(int(info.max) - z, z - int(info.min))


def chunks(wc: np.ndarray, code_range: int) -> list[tuple[int, int]]:
    """Splits of the reduction axis of ``wc`` (O, K) whose sums stay exact in float32:
    ``code_range * sum_{k in chunk} |wc[o, k]| < 2**24`` for every ``o`` (greedy, in order)."""
    cum = np.zeros((wc.shape[0], wc.shape[1] + 1))
    np.cumsum(np.abs(wc.astype(np.float64)), axis=1, out=cum[:, 1:])
    limit = (EXACT_FLOAT32 - 1) // code_range
    out, k0 = [], 0
    while k0 < wc.shape[1]:
        span = (cum[:, k0 + 1 :] - cum[:, k0 : k0 + 1]).max(axis=0)  # non-decreasing in k
        k1 = k0 + max(1, int(np.searchsorted(span, limit, side="right")))  # 1 tap: 2**16 max
        out.append((k0, k1))
        k0 = k1
    return out


def _product(wc: np.ndarray, cols_t: np.ndarray, x, x_zero, bound: float) -> np.ndarray:
    """``wc @ cols_t``: one float32 or float64 product, or (sums beyond 2**24) float32
    products over ``chunks`` of the reduction added in float64 (exact below 2**53)."""
    if wc.dtype == np.float64 or bound < EXACT_FLOAT32:
        return np.matmul(wc, cols_t)
    key = (id(wc), "chunks", _code_range(x, x_zero))
    hit = _CACHE.get(key)
    if hit is None or hit[0]() is not wc:
        hit = (_ref(wc, key), chunks(wc, key[2]))
        _CACHE[key] = hit
    if len(hit[1]) > 8:  # 16-bit inputs: too many small products; one float64 product
        return np.matmul(wc.astype(np.float64), cols_t.astype(np.float64))
    out = None
    for k0, k1 in hit[1]:
        part = np.matmul(wc[:, k0:k1], cols_t[..., k0:k1, :])
        out = part.astype(np.float64) if out is None else np.add(out, part, out=out)
    return out


def _geometry(x_shape, w_shape, strides, pads, dilations) -> tuple[int, int]:
    (_, _, h, wd), (_, _, kh, kw) = x_shape, w_shape
    oh = (h + pads[0] + pads[2] - (kh - 1) * dilations[0] - 1) // strides[0] + 1
    ow = (wd + pads[1] + pads[3] - (kw - 1) * dilations[1] - 1) // strides[1] + 1
    return oh, ow


def conv2d_sums(x, x_zero, w, w_zero, strides, pads, dilations, group, bound) -> np.ndarray | None:
    """The (N, O, OH, OW) sums of a 2-D convolution of codes ``x`` (N, C, H, W) with weight
    codes ``w`` (O, C/group, KH, KW), exact (module docstring); None for the layouts that
    ``_linear.conv_sums`` keeps (groups other than 1 and depthwise, or int64 sums)."""
    dtype = sum_dtype(bound)
    if dtype is np.float64 and group == 1:
        dtype = np.float32  # float32 products over chunks of the reduction (``_product``)
    n, c, _, _ = x.shape
    o, cg, kh, kw = w.shape
    if dtype is np.int64 or not (group == 1 or (cg == 1 and o == group == c)):
        return None
    oh, ow = _geometry(x.shape, w.shape, strides, pads, dilations)
    (sh, sw), (dh, dw) = strides, dilations
    if group > 1:  # depthwise
        wc = _prepared(w, w_zero, dtype, "ckk")
        xp = np.pad(centered(x, x_zero, dtype), ((0, 0), (0, 0), (pads[0], pads[2]),
                                                  (pads[1], pads[3])))  # fmt: skip
        out = np.zeros((n, c, oh, ow), dtype)
        for i in range(kh):
            for j in range(kw):
                view = xp[:, :, i * dh : i * dh + (oh - 1) * sh + 1 : sh,
                          j * dw : j * dw + (ow - 1) * sw + 1 : sw]  # fmt: skip
                out += view * wc[None, :, i, j, None, None]
        return out
    if kh == kw == 1 and not any(pads):
        wc = _prepared(w, w_zero, dtype, "oc")
        xs = x[:, :, : (oh - 1) * sh + 1 : sh, : (ow - 1) * sw + 1 : sw]
        xs = centered(xs, x_zero, dtype).reshape(n, c, oh * ow)
        return _product(wc, xs, x, x_zero, bound).reshape(n, o, oh, ow)
    wc = _prepared(w, w_zero, dtype, "okkc")
    xt = centered(x.transpose(0, 2, 3, 1), x_zero, dtype)  # NHWC
    xt = np.pad(xt, ((0, 0), (pads[0], pads[2]), (pads[1], pads[3]), (0, 0)))
    win = sliding_window_view(xt, ((kh - 1) * dh + 1, (kw - 1) * dw + 1), axis=(1, 2))
    win = win[:, ::sh, ::sw, :, ::dh, ::dw][:, :oh, :ow]  # N, OH, OW, C, KH, KW
    cols = np.ascontiguousarray(win.transpose(0, 1, 2, 4, 5, 3)).reshape(n, oh * ow, -1)
    return _product(wc, cols.transpose(0, 2, 1), x, x_zero, bound).reshape(n, o, oh, ow)
