"""Fixed-point requantization: a real multiplier as int32 ``multiplier`` and power-of-two ``shift``.

Bit-exact ports of TFLite's ``QuantizeMultiplier`` / ``MultiplyByQuantizedMultiplier`` and of
gemmlowp's ``SaturatingRoundingDoublingHighMul`` / ``RoundingDivideByPOT`` (``fixedpoint.h``),
computed with int64 numpy arithmetic so that no intermediate overflows.
"""

from __future__ import annotations

import math

import numpy as np

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


def quantize_multiplier(real_multiplier: float) -> tuple[int, int]:
    """TFLite ``QuantizeMultiplier``: ``real ~= multiplier * 2**(shift - 31)``.

    ``multiplier`` is an int32 in ``[2**30, 2**31)`` (a Q0.31 fraction in ``[0.5, 1)``) and
    ``shift`` an int, positive meaning a left shift. Steps:

    1. ``real = q * 2**shift`` with ``q`` in ``[0.5, 1)`` (``frexp``);
    2. ``multiplier = round_half_away_from_zero(q * 2**31)`` (TfLiteRound; exact in float64:
       ``q * 2**31`` is a power-of-two scaling and adding 0.5 to a value below 2**31 is exact);
    3. if rounding reached ``2**31``, halve it and increment ``shift``;
    4. if ``shift < -31`` every int32 input would round to 0: return ``(0, 0)`` (TFLite's
       flush-to-zero). ``real == 0`` also gives ``(0, 0)``.

    Relative error ``|multiplier * 2**(shift-31) - real| / real <= 2**-31``.
    ValueError for negative, NaN or infinite ``real_multiplier``.
    """
    real = float(real_multiplier)
    if not math.isfinite(real) or real < 0:
        raise ValueError(f"real_multiplier must be finite and >= 0, got {real_multiplier!r}")
    if real == 0.0:
        return 0, 0
    q, shift = math.frexp(real)
    multiplier = math.floor(q * 2.0**31 + 0.5)
    if multiplier == 2**31:
        multiplier //= 2
        shift += 1
    if shift < -31:
        return 0, 0
    return int(multiplier), int(shift)


def saturating_rounding_doubling_high_mul(a: np.ndarray, b: int) -> np.ndarray:
    """gemmlowp ``SaturatingRoundingDoublingHighMul(a, b)`` on int32 values held in int64.

    ``(a * b + nudge) / 2**31`` with C++ truncating division, ``nudge = 2**30`` if ``a*b >= 0``
    else ``1 - 2**30``: that is ``a * b / 2**31`` rounded to nearest with ties rounded up
    (toward +inf: 1.5 -> 2 but -1.5 -> -1).
    The single overflow case ``a == b == INT32_MIN`` saturates to INT32_MAX.
    """
    a = np.asarray(a, dtype=np.int64)
    ab = a * np.int64(b)
    nudge = np.where(ab >= 0, np.int64(1 << 30), np.int64(1 - (1 << 30)))
    t = ab + nudge
    high = np.where(t >= 0, t >> 31, -((-t) >> 31))
    overflow = (a == b) & (a == INT32_MIN)
    return np.where(overflow, np.int64(INT32_MAX), high)


def rounding_divide_by_pot(x: np.ndarray, exponent: int) -> np.ndarray:
    """gemmlowp ``RoundingDivideByPOT(x, exponent)``: ``x / 2**exponent`` rounded to nearest,
    ties away from zero, for ``0 <= exponent <= 31`` (arithmetic shift plus a rounding bit)."""
    if not 0 <= exponent <= 31:
        raise ValueError(f"exponent must be in [0, 31], got {exponent}")
    x = np.asarray(x, dtype=np.int64)
    mask = (1 << exponent) - 1
    remainder = x & mask
    threshold = (mask >> 1) + (x < 0)
    return (x >> exponent) + (remainder > threshold)


def _check_int32_values(x: object) -> np.ndarray:
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"x must hold integers (int32 accumulators), got dtype {x.dtype}")
    x = x.astype(np.int64)
    if x.size and (x.min() < INT32_MIN or x.max() > INT32_MAX):
        raise ValueError(f"x must fit in int32, got values in [{x.min()}, {x.max()}]")
    return x


def multiply_by_quantized_multiplier(x: np.ndarray, multiplier: int, shift: int) -> np.ndarray:
    """TFLite ``MultiplyByQuantizedMultiplier``: ``x * multiplier * 2**(shift - 31)``, rounded.

    For int32 values ``x`` (given as any integer array whose values fit in int32):

    1. ``left = max(shift, 0)``, ``right = max(-shift, 0)`` (must be ``<= 31``);
    2. ``a = saturate_int32(x * 2**left)`` -- TFLite computes ``x * (1 << left)`` in int32, which
       is undefined on overflow; here it saturates (identical wherever TFLite is defined).
       Saturation comes before the multiply, so with a left shift results saturate near
       ``INT32_MAX * multiplier / 2**31`` (2**30 for multiplier 2**30), not at INT32_MAX;
    3. ``h = SaturatingRoundingDoublingHighMul(a, multiplier)``;
    4. ``y = RoundingDivideByPOT(h, right)``.

    Returns int32, same shape as ``x``. Unsaturated results are within 1 of
    ``round(x * real)`` (two roundings of half an LSB each plus the 2**-31 relative error of
    the multiplier; see tests).
    """
    if isinstance(multiplier, bool) or not isinstance(multiplier, (int, np.integer)):
        raise TypeError(f"multiplier must be an int, got {multiplier!r}")
    if not INT32_MIN <= multiplier <= INT32_MAX:
        raise ValueError(f"multiplier must fit in int32, got {multiplier}")
    if not isinstance(shift, (int, np.integer)) or shift < -31:
        raise ValueError(f"shift must be an int >= -31, got {shift!r}")
    x = _check_int32_values(x)
    left, right = max(int(shift), 0), max(-int(shift), 0)
    # 2**32 is enough to saturate any nonzero int32, and |x| * 2**32 <= 2**63 fits int64.
    a = np.clip(x * np.int64(1 << min(left, 32)), INT32_MIN, INT32_MAX)
    high = saturating_rounding_doubling_high_mul(a, int(multiplier))
    return rounding_divide_by_pot(high, right).astype(np.int32)
