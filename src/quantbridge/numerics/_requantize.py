"""Integer requantization with one rounding: ``y = clip(z + round_half_even(acc * M / 2**n))``.

This is the rescale every integer-only kernel ends in (``quantbridge.integer``): an int32 (or
wider) accumulator ``acc`` holding ``real / acc_scale`` becomes the output code of scale
``out_scale`` through an integer multiplier ``M`` and a right shift ``n`` with
``M / 2**n ~= acc_scale / out_scale``.

Rounding rule, and why not gemmlowp's: TFLite's default ``MultiplyByQuantizedMultiplier``
rounds twice (``SaturatingRoundingDoublingHighMul``, then ``RoundingDivideByPOT``; see
``_fixed_point``), which can land one code away from the correctly rounded result. Here the
product ``acc * M`` is formed exactly in int64 and rounded once (as TFLite's
``TFLITE_SINGLE_ROUNDING`` build does), and ties go to even -- the rule of ONNX QuantizeLinear
and of torch, so wherever the float QDQ model computes exactly (power-of-two scales: every value
is a dyadic rational and ties are common) the integer program gives the same codes, not the
other neighbour on every tie. One rounding also makes a power-of-two scale ratio a pure shift
that computes *the same integers* as the multiplier form (both round the same rational number
``acc * 2**k / 2**n``). Integer ONNX (int64 Mul, Add, shifts) and C (``int64_t``) express it
in a few operations, with no emulation of gemmlowp's saturating high multiply.

Overflow contract: the caller guarantees ``|acc| * M < 2**62`` (``fixed_point_multiplier``'s
``bits`` argument chooses ``M`` small enough for a known accumulator bound); then every
intermediate fits int64.
"""

from __future__ import annotations

import math

import numpy as np

MAX_RIGHT_SHIFT = 62  # 2**(n-1) must fit int64 beside acc * M


def _split_real(real: float) -> tuple[float, int]:
    if not (math.isfinite(real) and real >= 0):
        raise ValueError(f"a requantization multiplier must be finite and >= 0, got {real!r}")
    return math.frexp(real)  # real = frac * 2**exp, frac in [0.5, 1)


def is_power_of_two(real: float) -> bool:
    """True when ``real == 2**k`` exactly for an integer ``k`` (a pure-shift rescale)."""
    frac, _ = _split_real(float(real))
    return frac == 0.5


def fixed_point_multiplier(real: float, bits: int = 31) -> tuple[int, int]:
    """``real ~= multiplier / 2**shift``, ``multiplier`` an integer below ``2**bits``.

    * ``real == 2**k`` (power-of-two scales): ``multiplier = 1``, ``shift = -k`` -- a pure
      shift, right for ``k < 0``, left for ``k > 0`` (negative ``shift``);
    * otherwise ``real = frac * 2**exp`` with ``frac`` in ``[0.5, 1)``, ``multiplier =
      round_half_away_from_zero(frac * 2**bits)`` (in ``[2**(bits-1), 2**bits]``; reaching
      ``2**bits`` halves it and decrements ``shift``), ``shift = bits - exp``. Relative error
      ``<= 2**-bits``;
    * ``real == 0``, or a shift beyond ``MAX_RIGHT_SHIFT`` (every accumulator within the
      overflow contract rounds to 0): ``(0, 0)``.

    ``bits`` in ``[1, 31]``: pick ``bits <= 62 - log2(max |acc|)`` so that ``acc * M`` cannot
    overflow int64 (31 bits for int32 accumulators).
    """
    if not 1 <= bits <= 31:
        raise ValueError(f"bits must be in [1, 31], got {bits}")
    frac, exp = _split_real(float(real))
    if frac == 0.0:
        return 0, 0
    if frac == 0.5:
        multiplier, shift = 1, 1 - exp
    else:
        multiplier, shift = math.floor(frac * 2.0**bits + 0.5), bits - exp
        if multiplier == 2**bits:
            multiplier, shift = multiplier // 2, shift - 1
    if shift > MAX_RIGHT_SHIFT:
        return 0, 0
    if shift < -31:
        raise ValueError(f"requantization multiplier {real!r} >= 2**31: the scales are broken")
    return int(multiplier), int(shift)


def fixed_point_multipliers(reals: object, bits: int = 31) -> tuple[np.ndarray, np.ndarray]:
    """``fixed_point_multiplier`` element by element: int64 arrays ``(multiplier, shift)``."""
    reals = np.asarray(reals, dtype=np.float64)
    pairs = [fixed_point_multiplier(float(r), bits) for r in reals.reshape(-1)]
    multiplier = np.array([m for m, _ in pairs], dtype=np.int64).reshape(reals.shape)
    shift = np.array([s for _, s in pairs], dtype=np.int64).reshape(reals.shape)
    return multiplier, shift


def common_shift_multipliers(reals: object, bits: int = 31) -> tuple[np.ndarray, int]:
    """Several multipliers over one shared right shift: ``reals[i] ~= multiplier[i] / 2**shift``.

    For sums of rescaled terms (Add, Concat): ``sum_i x_i * reals[i]`` becomes
    ``rounding_shift_right(sum_i x_i * multiplier[i], shift)``, rounded once. The shift is the
    largest real's ``fixed_point_multiplier`` shift (its multiplier has ``bits`` bits, the
    others fewer; at most ``MAX_RIGHT_SHIFT``); when every real is a power of two the multipliers are powers of two
    (shifts) and ``shift >= 0`` is the smallest that makes them integers.
    """
    reals = np.asarray(reals, dtype=np.float64).reshape(-1)
    if all(is_power_of_two(r) for r in reals):
        exps = [math.frexp(r)[1] - 1 for r in reals]
        shift = max(0, -min(exps))
        return np.array([1 << (e + shift) for e in exps], dtype=np.int64), shift
    _, exp = _split_real(float(reals.max()))
    shift = min(max(bits - exp, 0), MAX_RIGHT_SHIFT)
    multiplier = np.floor(reals * 2.0**shift + 0.5).astype(np.int64)
    return multiplier, int(shift)


def rounding_shift_right(x: object, shift: object) -> np.ndarray:
    """``x / 2**shift`` rounded to nearest, ties to even, on int64 (``shift >= 1``):

        ``(x + 2**(shift-1) - 1 + ((x >> shift) & 1)) >> shift``

    with arithmetic (flooring) shifts: ``x >> shift`` is ``floor(x / 2**shift)`` and its low bit
    says whether that floor is odd, in which case a tie goes up (0.5 -> 0, 1.5 -> 2, -0.5 -> 0,
    -1.5 -> -2, 2.5 -> 2). ``shift <= 0`` is an exact left shift ``x * 2**-shift``. ``shift``
    broadcasts against ``x`` (per-channel shifts).
    """
    x = np.asarray(x, dtype=np.int64)
    shift = np.asarray(shift, dtype=np.int64)
    if shift.size and shift.min() >= 1:  # right shifts only: the same formula, fewer passes
        y = x + ((np.int64(1) << (shift - 1)) - 1)
        y += np.right_shift(x, shift) & 1
        y >>= shift
        return y
    right = np.maximum(shift, 0)
    left = np.maximum(-shift, 0)
    half_minus_one = np.where(
        right > 0, np.left_shift(np.int64(1), np.maximum(right - 1, 0)) - 1, 0
    )
    odd = np.where(right > 0, np.right_shift(x, right) & 1, 0)
    return np.left_shift(np.right_shift(x + half_minus_one + odd, right), left)


def requantize(
    acc: object,
    multiplier: object,
    shift: object,
    zero_point: int,
    qmin: int,
    qmax: int,
) -> np.ndarray:
    """Output codes from an integer accumulator, in this order (all int64):

    1. ``p = acc * multiplier``                     -- exact (overflow contract above);
    2. ``r = round_half_even(p / 2**shift)``       -- one rounding (``rounding_shift_right``);
                                                      a left shift when ``shift <= 0``;
    3. ``y = clip(r + zero_point, qmin, qmax)``    -- saturation in int64, then the caller casts.

    Computes ``round(acc * real) + zero_point`` saturated, for ``real ~= multiplier / 2**shift``.
    ``multiplier`` and ``shift`` broadcast against ``acc`` (per-channel, per-position).
    """
    product = np.asarray(acc, dtype=np.int64) * np.asarray(multiplier, dtype=np.int64)
    rounded = rounding_shift_right(product, shift)
    rounded = rounded + np.int64(zero_point)
    return np.clip(rounded, qmin, qmax, out=rounded if rounded.ndim else None)
