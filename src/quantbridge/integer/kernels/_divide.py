"""Integer division: L2 normalization, the L2 norm, and the quotient of two tensors.

All three end in one rounding, ``numerics.divide_half_even`` (to nearest, ties to even: the
rule of ``requantize`` and of ONNX QuantizeLinear) or ``numerics.requantize``; ``isqrt_newton``
is the floor of the square root. Codes ``q`` mean ``r = s (q - z)``; everything is int64.

``l2_normalize`` (``x / max(||x||, eps)``, ``x / (||x|| + eps)``, ONNX LpNormalization p=2;
over ``axes``, input ``(s, z)``, output ``(s_y, z_y)``, ``1 / s_y ~= M / 2**n``):
    c_i = q_i - z,  S2 = sum c_i**2                     exact (|S2| <= N 2**32 for int16 codes)
    R   = isqrt_newton(max(S2 4**k, 1))                 ~= 2**k sqrt(S2) = 2**k ||x|| / s
    D   = max(R, E) or R + E, then max(D, 1)            E = round(eps / s 2**k): the float eps
    q_y = clip(z_y + divide_half_even(c_i M 2**L, D 2**P))    L - P = k - n
    (``s`` cancels: ``x_i / ||x|| = c_i / sqrt(S2)``.) ``k`` keeps ``S2 4**k < 2**62``; ``M``'s
    bits keep both operands of the division below ``2**62`` (lowering). A zero row gives
    ``0 / max(0, eps) = 0``: the code ``z_y``, as in float.

``l2_norm`` (ReduceL2, output ``(s_y, z_y)``):
    R   = isqrt_newton(S2 4**k) (0 for S2 = 0)          ~= 2**k ||x|| / s
    q_y = requantize(R, M, n, z_y)                      M / 2**n ~= s / (2**k s_y)
    (the floor of the root is at most 2**-k of an input step below the root: far below the
    output's half step; the requantization rounds once).

``divide`` (``a / d`` of two code tensors, broadcast; ``s_a / (s_d s_y) ~= M / 2**n``):
    A = (q_a - z_a) M 2**L,  B = (q_d - z_d) 2**P       L - P = -n; |A|, |B| < 2**62
    q_y = clip(z_y + divide_half_even(sign(B) A, |B|))  for B != 0
    B == 0 (the denominator's code is its zero point): the float model divides by 0, +-inf
    saturates to qmax / qmin by the sign of A; 0 / 0 gives z_y (the value 0, as a float
    model's ``eps`` in the denominator would).
"""

from __future__ import annotations

import numpy as np

from ...numerics import divide_half_even, isqrt_newton, requantize
from ._registry import register_kernel


def row_root(attrs, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(c, R)``: the centered codes and ``isqrt(S2 4**k)`` per row (kept axes), R >= 0."""
    c = x.astype(np.int64) - np.int64(attrs["x_zero"])
    s2 = (c * c).sum(axis=tuple(attrs["axes"]), keepdims=True)
    r = isqrt_newton(np.maximum(s2 << (2 * attrs["k"]), 1))
    return c, np.where(s2 == 0, 0, r)


@register_kernel("l2_normalize")
def l2_normalize(attrs, x: np.ndarray) -> np.ndarray:
    c, r = row_root(attrs, x)
    e = np.int64(attrs["eps"])
    d = np.maximum(np.maximum(r, e) if attrs["eps_mode"] == "max" else r + e, 1)
    num = (c * np.int64(attrs["multiplier"])) << attrs["left"]
    y = divide_half_even(num, d << attrs["right"]) + np.int64(attrs["out_zero"])
    return np.clip(y, attrs["qmin"], attrs["qmax"]).astype(attrs["dtype"])


@register_kernel("l2_norm")
def l2_norm(attrs, x: np.ndarray) -> np.ndarray:
    _, r = row_root(attrs, x)
    if not attrs["keepdims"]:
        r = r.squeeze(axis=tuple(attrs["axes"]))
    y = requantize(r, attrs["multiplier"], attrs["shift"], attrs["out_zero"], attrs["qmin"],
                   attrs["qmax"])  # fmt: skip
    return np.asarray(y).astype(attrs["dtype"])


@register_kernel("divide")
def divide(attrs, a: np.ndarray, d: np.ndarray) -> np.ndarray:
    num = (a.astype(np.int64) - np.int64(attrs["a_zero"])) * np.int64(attrs["multiplier"])
    num = num << attrs["left"]
    den = (d.astype(np.int64) - np.int64(attrs["d_zero"])) << attrs["right"]
    num, den = np.broadcast_arrays(np.where(den < 0, -num, num), np.abs(den))
    z = np.int64(attrs["out_zero"])
    y = z + divide_half_even(num, np.maximum(den, 1))
    saturated = np.where(num > 0, attrs["qmax"], np.where(num < 0, attrs["qmin"], z))
    y = np.where(den == 0, saturated, y)
    return np.clip(y, attrs["qmin"], attrs["qmax"]).astype(attrs["dtype"])
