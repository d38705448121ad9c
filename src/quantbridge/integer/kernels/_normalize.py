"""Row normalizations on integer codes: softmax and layer normalization.

``softmax`` (over the last axis; input 8-bit codes ``q``, ``r = s (q - z)``, times a positive
constant ``c`` the lowering folded in: ``beta = c s`` per code):
    d_j = max_k q_k - q_j                                  in [0, 2**bits - 1]
    e_j = table[min(d_j, L - 1)] = round(2**16 exp(-beta d_j))   exact table (float64 offline)
    (L = 2**bits entries for 8-bit codes; for 16-bit score codes the table stops at the first
    difference whose entry rounds to 0, ``L - 1 > 17 ln 2 / beta``, and larger ones read that 0)
    S   = sum_j e_j                                        int32: S <= K 2**16 < 2**31
    p_j = min(round_divide(e_j 2**15, S), 2**15 - 1)       int16 codes, scale 2**-15, zero 0
    (``numerics.round_divide``: to nearest, ties up; the clamp costs at most 2**-15 when one
    element holds all the mass). The max subtraction is TFLite's; the table of code differences
    is TFLite's int8 softmax with an exact (not polynomial) exp.
    An optional second input ``keep`` (uint8, broadcast to ``q``; an attention mask): ``e_j = 0``
    where it is 0 and the maximum runs over the kept codes; a row with nothing kept is uniform.

``layernorm`` (over the trailing ``N`` elements; input codes, output (s_y, z_y)):
    c_i = q_i - z, S1 = sum c_i, S2 = sum c_i**2           int64 (|S2| <= N 2**16)
    V   = N S2 - S1**2 = N**2 var(c)                      int64, >= 0
    W   = V 4**k + E, E = max(1, round(N**2 eps / s**2 4**k))   k chosen so that W < 2**62
    R   = isqrt_newton(W) ~= 2**k N sqrt(var(c) + eps / s**2)
    D_i = N c_i - S1                                       = N (c_i - mean)
    T_i = round_divide(D_i 2**(k + F), R) ~= x_hat_i 2**F  (the normalized value, F fraction bits)
    q_y = clip(z_y + round_half_even((T_i M_i + B_i) / 2**n))   (``numerics.requantize``)
    with M_i / 2**n ~= gamma_i 2**-F / s_y (one shared shift) and B_i = round(beta_i 2**n / s_y).
"""

from __future__ import annotations

import numpy as np

from ...numerics import isqrt_newton, requantize, round_divide
from ._registry import register_kernel

SOFTMAX_EXP_BITS = 16  # table[0] = 2**16
SOFTMAX_OUT_BITS = 15  # probabilities as int16 codes of scale 2**-15


@register_kernel("softmax")
def softmax(attrs, x: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
    q = x.astype(np.int64)
    table = attrs["table"]
    if keep is not None:
        return _masked_softmax(q, np.broadcast_to(keep != 0, q.shape), table)
    e = table[np.minimum(q.max(axis=-1, keepdims=True) - q, len(table) - 1)]
    total = e.sum(axis=-1, keepdims=True)
    p = round_divide(e << SOFTMAX_OUT_BITS, total)
    return np.minimum(p, 2**SOFTMAX_OUT_BITS - 1).astype(np.int16)


def _masked_softmax(q: np.ndarray, keep: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``e_j = 0`` where ``keep`` is 0 (a score masked by -inf), the maximum over the kept
    codes; a row with none kept is uniform (``e_j = table[0]``: float32 softmax gives that for
    a finfo.min fill, NaN for -inf)."""
    full = ~keep.any(axis=-1, keepdims=True)
    keep = keep | full
    top = np.where(keep, q, np.iinfo(np.int64).min).max(axis=-1, keepdims=True)
    d = np.where(keep & ~full, np.minimum(top - q, len(table) - 1), 0)
    e = np.where(keep, table[d], 0)
    p = round_divide(e << SOFTMAX_OUT_BITS, e.sum(axis=-1, keepdims=True))
    return np.minimum(p, 2**SOFTMAX_OUT_BITS - 1).astype(np.int16)


def layernorm_rows(attrs, x: np.ndarray) -> np.ndarray:
    """The normalized values ``T`` (``F`` fraction bits) of each row of ``N`` trailing elements,
    shape ``(rows, N)``."""
    n = attrs["n"]
    c = x.astype(np.int64).reshape(-1, n) - np.int64(attrs["x_zero"])
    s1 = c.sum(axis=1, keepdims=True)
    s2 = (c * c).sum(axis=1, keepdims=True)
    w = ((n * s2 - s1 * s1) << (2 * attrs["k"])) + np.int64(attrs["eps"])
    r = isqrt_newton(w)
    return round_divide((n * c - s1) << (attrs["k"] + attrs["frac"]), r)


@register_kernel("layernorm")
def layernorm(attrs, x: np.ndarray) -> np.ndarray:
    m = np.asarray(attrs["multipliers"], np.int64)  # n per row, or P n repeating every P rows
    t = layernorm_rows(attrs, x).reshape(-1, m.size)
    acc = t * m + np.asarray(attrs["offsets"], np.int64)
    y = requantize(acc, 1, attrs["shift"], attrs["out_zero"], attrs["qmin"], attrs["qmax"])
    return y.reshape(x.shape).astype(attrs["dtype"])


@register_kernel("row_squares")
def row_squares(attrs, x: np.ndarray) -> np.ndarray:
    """``code = base + sign * #{thresholds <= S2}`` with ``S2 = sum (q - z)**2`` over the last
    axis (kept, size 1): a monotone function of a row's mean square (``lowering._rms``); with
    ``centered``, ``S2 = N sum (q - z)**2 - (sum (q - z))**2 = N**2 var`` (a layer norm's
    variance written out: ``mean((x - mean(x))**2)``)."""
    c = x.astype(np.int64) - np.int64(attrs["x_zero"])
    s2 = (c * c).sum(axis=-1, keepdims=True)
    if attrs.get("centered", False):
        s1 = c.sum(axis=-1, keepdims=True)
        s2 = c.shape[-1] * s2 - s1 * s1
    k = np.searchsorted(np.asarray(attrs["thresholds"], np.int64), s2, side="right")
    return (attrs["base"] + attrs["sign"] * k).astype(attrs["dtype"])
