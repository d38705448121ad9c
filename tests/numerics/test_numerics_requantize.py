"""``numerics._requantize``: single-rounding fixed-point requantization against exact rationals
(Python ``fractions``), the power-of-two pure-shift identity, and golden ties."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantbridge.numerics import (
    common_shift_multipliers,
    fixed_point_multiplier,
    requantize,
    rounding_shift_right,
)


def _round_half_even(f: Fraction) -> int:
    return round(f)  # Python's round on Fraction: nearest, ties to even (exact)


@pytest.mark.parametrize(
    ("x", "shift", "expected"),
    [(1, 1, 0), (3, 1, 2), (5, 1, 2), (-1, 1, 0), (-3, 1, -2), (-5, 1, -2), (6, 2, 2),
     (2, 2, 0), (-2, 2, 0), (-6, 2, -2), (7, 2, 2), (-7, 2, -2), (5, 0, 5), (5, -3, 40)],
)  # fmt: skip
def test_rounding_shift_right_golden_ties(x, shift, expected):
    assert int(rounding_shift_right(x, shift)) == expected


@settings(max_examples=150, deadline=None)
@given(st.integers(-(2**61), 2**61), st.integers(1, 62))
def test_rounding_shift_right_is_round_half_even(x, shift):
    assert int(rounding_shift_right(x, shift)) == _round_half_even(Fraction(x, 2**shift))


@settings(max_examples=150, deadline=None)
@given(
    st.integers(-(2**31), 2**31 - 1),
    st.floats(1e-9, 1e3, allow_nan=False),
    st.integers(-128, 127),
)
def test_requantize_is_one_rounding_of_the_exact_product(acc, real, zero):
    m, n = fixed_point_multiplier(real)
    got = int(requantize(np.int64(acc), m, n, zero, -(2**62), 2**62))
    assert got == _round_half_even(Fraction(acc * m) / Fraction(2) ** n) + zero
    # and it is within one code (plus the multiplier's 2**-31 relative error) of acc * real
    assert abs(got - zero - acc * real) <= 0.5 + abs(acc * real) * 2.0**-30 + 1e-9


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-12, 1e6, allow_nan=False), st.integers(1, 31))
def test_fixed_point_multiplier_relative_error(real, bits):
    m, n = fixed_point_multiplier(real, bits)
    if m == 0:
        assert real * 2.0**31 < 2**-31 * 2.0**31 or n == 0
        return
    assert m < 2**bits
    assert abs(m / 2.0**n - real) <= real * 2.0 ** -(bits - 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(-(2**31), 2**31 - 1), st.integers(-20, 20))
def test_power_of_two_is_a_pure_shift_with_the_same_codes(acc, k):
    m, n = fixed_point_multiplier(2.0**k)
    assert m == 1 and n == -k
    # the same integers as a 31-bit multiplier form of the same power of two
    pure = requantize(np.int64(acc), 1, -k, 0, -(2**62), 2**62)
    multiplied = requantize(np.int64(acc), 2**30, 30 - k, 0, -(2**62), 2**62)
    assert int(pure) == int(multiplied) == _round_half_even(Fraction(acc) * Fraction(2) ** k)


def test_saturation_and_per_channel_broadcast():
    acc = np.array([[-(10**6), 0, 10**6], [5, 6, 7]], np.int64)
    y = requantize(acc, np.array([[1], [3]]), np.array([[0], [1]]), 3, -128, 127)
    assert y.tolist() == [[-128, 3, 127], [11, 12, 13]]  # 21 / 2 = 10.5 -> 10 (even)


def test_common_shift_multipliers():
    m, n = common_shift_multipliers([0.75, 0.1])
    assert n == 31 and m[0] == round(0.75 * 2**31) and m[1] == round(0.1 * 2**31)
    m, n = common_shift_multipliers([0.25, 2.0, 1.0])
    assert n == 2 and m.tolist() == [1, 8, 4]
    with pytest.raises(ValueError, match="finite"):
        fixed_point_multiplier(float("nan"))
