"""Weight codes whose adjacent pairs cannot saturate an int16 pair sum (x86 without VNNI).

x86 int8 kernels without VNNI (ONNX Runtime's MLAS, oneDNN on AVX2) multiply uint8 activation
codes ``a`` by int8 weight codes ``q`` with ``vpmaddubsw``: two adjacent products along the
reduction axis are added into an int16 with saturation, ``sat16(a_0 q_0 + a_1 q_1)``
(``quantbridge._platform``). With ``a`` in ``[0, a_max]`` the pair sum stays in int16 for every
input exactly when

.. math:: |q_0| + |q_1| \\le B = \\lfloor 32767 / a_{max} \\rfloor \\quad
          \\text{for every pair with } q_0 q_1 > 0

(a pair of opposite signs sums to at most ``a_max * max(|q_0|, |q_1|) <= 255 * 128 = 32640``);
``B = 128`` for uint8. The raw codes count, not ``a - z``: the engines subtract the activation zero
point after the accumulation. ``|q| <= B / 2`` (7-bit weights, ``int8_avx2``) meets it for
every pair; 8-bit weights meet it for most pairs and break it where two large same-sign weights
meet.

``pair_bounded_codes`` gives, for real-valued codes ``t = w / s`` laid out as rows
``(channels, K)`` in the engine's reduction order (pairs ``(2j, 2j + 1)``; an odd ``K`` is padded
with a zero, as the engines pack it), the integer codes nearest to ``t`` in squared distance
under that constraint: round half to even and clip to ``[qmin, qmax]``; where a same-sign pair
breaks the bound, the nearest integer point of the pair on ``|q_0| + |q_1| = B`` (the nearest
lattice point of the half-plane lies on its boundary line, since the lattice points of the
next line are further by ``1 / sqrt 2`` across and no nearer along): with ``x, y`` the pair's
magnitudes, ``|q_0| = round((x - y + B) / 2)`` clipped so that both magnitudes stay on the grid,
``|q_1| = B - |q_0|``, the signs kept.

``pair_bounded_scales`` picks each channel's scale ``s = r * max_j |w_ij| / qmax`` for ``r``
from 1 (the 8-bit min-max grid, some pairs projected) up to ``qmax / floor(B / 2)`` (the grid on
which no pair can break the bound) with the least ``sum_j d_j (w_ij - s q_ij)^2``; ties go to
the smaller ``r`` (the finer grid).
"""

from __future__ import annotations

import numpy as np

from ._weight_ranges import best_channel_scales

INT16_MAX = 32767
PAIR_SCALE_STEPS = 41  # ratios tried by ``pair_bounded_scales`` (as ``DEFAULT_RATIOS``)


def pair_bound(activation_qmax: int, accumulator_max: int = INT16_MAX) -> int:
    """``B``: the largest ``|q_0| + |q_1|`` of a same-sign pair for which ``a_0 q_0 + a_1 q_1``
    fits ``[-accumulator_max - 1, accumulator_max]`` for all codes ``a`` in
    ``[0, activation_qmax]`` (128 for uint8 into int16)."""
    if activation_qmax <= 0:
        raise ValueError(f"activation_qmax must be > 0, got {activation_qmax}")
    return int(accumulator_max // activation_qmax)


def broken_pairs(q: np.ndarray, bound: int) -> int:
    """How many same-sign pairs ``(2j, 2j + 1)`` of the integer codes ``q`` (2-D: channels, K in
    the engine's reduction order; an odd ``K`` padded with a zero) have ``|q_0| + |q_1| > bound``."""
    q = np.asarray(q, dtype=np.int64)
    if q.shape[1] % 2:
        q = np.pad(q, ((0, 0), (0, 1)))
    a, b = q[:, 0::2], q[:, 1::2]
    return int(((a * b > 0) & (np.abs(a) + np.abs(b) > bound)).sum())


def pair_bounded_codes(t: np.ndarray, qmin: int, qmax: int, bound: int) -> np.ndarray:
    """Integer codes (int64, the shape of ``t``) nearest to the real codes ``t`` (2-D: channels,
    K in the engine's reduction order) with every same-sign pair ``(2j, 2j + 1)`` of a row
    within ``|q_0| + |q_1| <= bound`` (module docstring), ``bound >= 1``."""
    t = np.asarray(t, dtype=np.float64)
    if t.ndim != 2:
        raise ValueError(f"pair_bounded_codes takes 2-D codes (channels, K), got {t.shape}")
    if bound < 1:
        raise ValueError(f"bound must be >= 1, got {bound}")
    rows, k = t.shape
    if k % 2:
        t = np.concatenate([t, np.zeros((rows, 1))], axis=1)
    q = np.clip(np.rint(t), qmin, qmax)
    a, b = q[:, 0::2], q[:, 1::2]
    broken = (a * b > 0) & (np.abs(a) + np.abs(b) > bound)
    sign = np.sign(a)
    x, y = sign * t[:, 0::2], sign * t[:, 1::2]  # the pair's magnitudes (same sign as a, b)
    top = np.where(sign > 0, qmax, -qmin)  # the largest magnitude the grid holds on that side
    lo = np.maximum(bound - top, 0)
    hi = np.minimum(top, bound)
    mag_a = np.clip(np.rint((x - y + bound) / 2), lo, hi)
    a = np.where(broken, sign * mag_a, a)
    b = np.where(broken, sign * (bound - mag_a), b)
    q[:, 0::2], q[:, 1::2] = a, b
    return q[:, :k].astype(np.int64)


def pair_bounded_scales(
    w: np.ndarray,
    qmin: int,
    qmax: int,
    bound: int,
    importance: np.ndarray | None = None,
    steps: int = PAIR_SCALE_STEPS,
) -> np.ndarray:
    """Per row of the 2-D ``w`` (channels, K in the engine's reduction order) the scale with the
    least ``sum_j d_j (w_ij - s q_ij)^2``, ``q = pair_bounded_codes(w / s)``, among
    ``s = r * max|w_i| / qmax`` for ``steps`` ratios ``r`` evenly from 1 to
    ``qmax / (bound // 2)`` (module docstring); ``importance`` ``d`` (None = 1). float32 scales,
    the error evaluated at the float32 scale returned; an all-zero row gets ``MIN_SCALE``."""
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"pair_bounded_scales takes a 2-D weight (channels, K), got {w.shape}")
    d = np.ones_like(w) if importance is None else np.asarray(importance, dtype=np.float64)
    amax = np.abs(w).max(axis=1)
    widest = max(1.0, qmax / max(bound // 2, 1))

    def error(scale: np.ndarray) -> np.ndarray:
        s = scale.astype(np.float64)[:, None]
        return (d * (w - s * pair_bounded_codes(w / s, qmin, qmax, bound)) ** 2).sum(axis=1)

    return best_channel_scales(amax, np.linspace(1.0, widest, steps), qmax, error)
