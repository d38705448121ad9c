"""``numerics.divide_half_even``: the quotient of integers rounded to nearest, ties to even,
against exact rational arithmetic (``fractions.Fraction``) and at the ties."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from quantbridge.numerics import divide_half_even


def _reference(a: int, b: int) -> int:
    """``round(a / b)`` on exact rationals: Python's ``round`` of a Fraction ties to even."""
    return round(Fraction(a, b))


@pytest.mark.parametrize(("a", "b", "q"), [(5, 2, 2), (7, 2, 4), (-5, 2, -2), (-7, 2, -4),
                                           (1, 2, 0), (-1, 2, 0), (3, 2, 2), (-3, 2, -2),
                                           (0, 7, 0), (9, 3, 3), (-9, 3, -3)])  # fmt: skip
def test_ties_go_to_even(a, b, q):
    assert int(divide_half_even(a, b)) == q


def test_random_quotients_match_exact_rounding():
    rng = np.random.default_rng(0)
    a = rng.integers(-(2**61), 2**61, 4000)
    b = rng.integers(1, 2**61, 4000)
    a[:2000] //= rng.integers(1, 2**40, 2000)  # small quotients and large ones
    got = divide_half_even(a, b)
    np.testing.assert_array_equal(
        got, [_reference(int(x), int(y)) for x, y in zip(a, b, strict=True)]
    )


def test_near_the_int64_limits():
    """``|a| < 2**63``, ``b < 2**62``: the doubled remainder still fits."""
    a = np.array([2**63 - 1, -(2**63) + 1, 2**62 + 1, -(2**62) - 1], np.int64)
    b = np.array([2**62 - 1, 2**62 - 1, 2, 2], np.int64)
    np.testing.assert_array_equal(divide_half_even(a, b),
                                  [_reference(int(x), int(y)) for x, y in zip(a, b, strict=True)])  # fmt: skip
