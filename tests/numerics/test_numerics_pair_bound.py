"""numerics.pair_bound / pair_bounded_codes / pair_bounded_scales against brute-force float64
references: the codes keep every same-sign pair within the bound and are the nearest such."""

import itertools

import numpy as np
import pytest

from quantbridge.numerics import pair_bound, pair_bounded_codes, pair_bounded_scales


def test_bound_is_the_int16_pair_sum_limit_of_uint8_codes():
    b = pair_bound(255)
    assert b == 128
    # the defining property, exhaustively over the codes that matter: for |q0| + |q1| <= b and
    # same signs the worst pair sum (both activations 255) fits int16; at b + 1 it does not
    assert 255 * b <= 32767 and 255 * (b + 1) > 32768
    with pytest.raises(ValueError, match="activation_qmax"):
        pair_bound(0)


def _nearest_brute(ta, tb, qmin, qmax, bound):
    """The least squared distance from (ta, tb) to an integer pair of the grid within the
    constraint, by enumerating every pair."""
    grid = np.array(list(itertools.product(range(qmin, qmax + 1), repeat=2)))
    a, b = grid[:, 0], grid[:, 1]
    ok = ~((a * b > 0) & (np.abs(a) + np.abs(b) > bound))
    return float((((a - ta) ** 2 + (b - tb) ** 2)[ok]).min())


def test_codes_are_the_nearest_pair_within_the_bound():
    """Against enumeration of every integer pair of a small grid ([-16, 15], bound 20): the
    distance of the returned pair equals the brute-force minimum (ties may pick either point),
    and the pair keeps the bound."""
    rng = np.random.default_rng(0)
    t = rng.uniform(-17, 16, size=(40, 6))
    t[0, :2] = [15.4, 14.6]  # both near the top: a broken pair
    t[1, :2] = [-16.0, -15.2]  # the negative side reaches one code further (qmin = -16)
    q = pair_bounded_codes(t, -16, 15, 20)
    assert q.dtype == np.int64
    for r in range(t.shape[0]):
        for j in range(0, 6, 2):
            a, b = int(q[r, j]), int(q[r, j + 1])
            assert -16 <= a <= 15 and -16 <= b <= 15
            assert not (a * b > 0 and abs(a) + abs(b) > 20)
            d = (a - t[r, j]) ** 2 + (b - t[r, j + 1]) ** 2
            assert d == pytest.approx(_nearest_brute(t[r, j], t[r, j + 1], -16, 15, 20))


def test_unbroken_pairs_round_to_nearest_and_odd_rows_pad_with_zero():
    t = np.array([[3.4, -120.2, 126.6, 1.2, 90.5]])  # odd K: the last code pairs with a zero
    q = pair_bounded_codes(t, -127, 127, 128)
    np.testing.assert_array_equal(q, [[3, -120, 127, 1, 90]])  # rint: half to even (90.5 -> 90)
    q = pair_bounded_codes(np.array([[100.2, 99.7]]), -127, 127, 128)
    np.testing.assert_array_equal(q, [[64, 64]])  # (100.2 - 99.7 + 128) / 2 = 64.25


def test_scales_are_the_argmin_over_ratios_and_never_break_the_bound():
    rng = np.random.default_rng(2)
    w = rng.standard_t(3, size=(12, 50)) * 0.1
    d = rng.uniform(0.1, 2.0, size=(12, 50))
    got = pair_bounded_scales(w, -127, 127, 128, d, steps=9)
    amax = np.abs(w).max(1)
    cand = np.stack(
        [(amax * r / 127).astype(np.float32) for r in np.linspace(1.0, 127 / 64, 9)]
    ).astype(np.float64)

    def err(s):  # an independent float64 reference of the constrained rounding's error
        q = np.stack(
            [pair_bounded_codes(w[i : i + 1] / s[i], -127, 127, 128)[0] for i in range(12)]
        )
        return (d * (w - s[:, None] * q) ** 2).sum(1)

    errs = np.stack([err(c) for c in cand])
    best = errs.argmin(0)  # the first minimum: the finer grid on ties
    np.testing.assert_array_equal(got, cand[best, np.arange(12)].astype(np.float32))
    assert (best > 0).any() and (best < 8).any()  # the data exercise more than one ratio
    # the widest candidate (max code 64) never needs the projection: a 7-bit-like grid
    widest = cand[-1]
    assert np.abs(np.rint(w / widest[:, None])).max() <= 64
    q = pair_bounded_codes(w / got.astype(np.float64)[:, None], -127, 127, 128)
    a, b = q[:, 0::2], q[:, 1::2]
    assert ((a * b <= 0) | (np.abs(a) + np.abs(b) <= 128)).all()


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="2-D"):
        pair_bounded_codes(np.ones(4), -127, 127, 128)
    with pytest.raises(ValueError, match="bound"):
        pair_bounded_codes(np.ones((1, 4)), -127, 127, 0)
    with pytest.raises(ValueError, match="2-D"):
        pair_bounded_scales(np.ones(4), -127, 127, 128)
