"""Fixed-point multiplier (TFLite/gemmlowp) and int32 bias quantization: golden values, a slow
Python-int reference of the gemmlowp formulas, and float64 property tests."""

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantbridge.numerics import (
    bias_scale,
    multiply_by_quantized_multiplier,
    quantize_bias,
    quantize_multiplier,
)

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


# --------------------------------------------------------------- slow Python-int reference
def ref_srdhm(a: int, b: int) -> int:
    """gemmlowp SaturatingRoundingDoublingHighMul with Python ints (C++ truncating division)."""
    if a == b == INT32_MIN:
        return INT32_MAX
    ab = a * b
    t = ab + (2**30 if ab >= 0 else 1 - 2**30)
    return t // 2**31 if t >= 0 else -((-t) // 2**31)


def ref_rdbpot(x: int, exponent: int) -> int:
    """gemmlowp RoundingDivideByPOT with Python ints (infinite two's complement == int32 here)."""
    mask = (1 << exponent) - 1
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> exponent) + (1 if (x & mask) > threshold else 0)


def ref_mbqm(x: int, multiplier: int, shift: int) -> int:
    left, right = max(shift, 0), max(-shift, 0)
    a = min(max(x * 2**left, INT32_MIN), INT32_MAX)
    return ref_rdbpot(ref_srdhm(a, multiplier), right)


# ------------------------------------------------------------------------- golden values
@pytest.mark.parametrize(
    ("real", "expected"),
    [
        (0.0, (0, 0)),
        (0.5, (2**30, 0)),
        (0.25, (2**30, -1)),
        (1.0, (2**30, 1)),
        (2.0, (2**30, 2)),
        (0.75, (3 * 2**29, 0)),
        (1 - 2.0**-40, (2**30, 1)),  # q * 2**31 rounds up to 2**31: halve, shift + 1
        (2.0**-31, (2**30, -30)),
        (2.0**-33, (0, 0)),  # shift would be -32: TFLite flushes to zero
    ],
)
def test_quantize_multiplier_golden(real, expected):
    assert quantize_multiplier(real) == expected


@pytest.mark.parametrize("real", [-0.5, float("nan"), float("inf"), -float("inf")])
def test_quantize_multiplier_rejects_negative_and_non_finite(real):
    with pytest.raises(ValueError, match="finite and >= 0"):
        quantize_multiplier(real)


def test_multiply_golden():
    m, s = quantize_multiplier(0.5)
    x = np.array([100, 3, -3, 1, -1, 5, -5, INT32_MAX, INT32_MIN], np.int32)
    # SRDHM alone (shift 0): ties round up, so 1.5 -> 2 and -1.5 -> -1, -0.5 -> 0.
    np.testing.assert_array_equal(
        multiply_by_quantized_multiplier(x, m, s),
        [50, 2, -1, 1, 0, 3, -2, 2**30, -(2**30)],
    )
    m, s = quantize_multiplier(0.25)  # right shift 1: RoundingDivideByPOT, ties away from zero
    np.testing.assert_array_equal(
        multiply_by_quantized_multiplier(np.array([6, -6, 2, -2]), m, s), [2, -2, 1, -1]
    )
    m, s = quantize_multiplier(4.0)  # 2**30 * 2**(3 - 31): x * 8 saturates in int32, then * 0.5
    out = multiply_by_quantized_multiplier(np.array([2**27, -(2**27), 2**29, -(2**29), 7]), m, s)
    np.testing.assert_array_equal(out, [2**29, -(2**29), 2**30, -(2**30), 28])
    assert out.dtype == np.int32


def test_multiply_rejects_bad_inputs():
    with pytest.raises(ValueError, match="fit in int32"):
        multiply_by_quantized_multiplier(np.array([2**31], np.int64), 2**30, 0)
    with pytest.raises(TypeError, match="integers"):
        multiply_by_quantized_multiplier(np.array([1.0]), 2**30, 0)
    with pytest.raises(ValueError, match="shift"):
        multiply_by_quantized_multiplier(np.array([1]), 2**30, -32)
    with pytest.raises(ValueError, match="multiplier"):
        multiply_by_quantized_multiplier(np.array([1]), 2**31, 0)


# ---------------------------------------------------------------------- property tests
reals = st.floats(2.0**-31, 2.0**20, allow_nan=False, allow_infinity=False)
int32s = st.integers(INT32_MIN, INT32_MAX)


@settings(max_examples=500, deadline=None)
@given(real=reals)
def test_quantize_multiplier_reconstructs_real(real):
    multiplier, shift = quantize_multiplier(real)
    assert 2**30 <= multiplier < 2**31
    reconstructed = Fraction(multiplier) * Fraction(2) ** (shift - 31)
    # multiplier = round(q * 2**31) with q >= 1/2: absolute error <= 1/2 on a value >= 2**30,
    # i.e. relative error <= 2**-31.
    assert abs(reconstructed - Fraction(real)) <= Fraction(real) * Fraction(1, 2**31)


@settings(max_examples=300, deadline=None)
@given(real=reals, xs=st.lists(int32s, min_size=1, max_size=30))
def test_multiply_equals_python_int_reference(real, xs):
    multiplier, shift = quantize_multiplier(real)
    out = multiply_by_quantized_multiplier(np.array(xs, np.int64), multiplier, shift)
    assert out.tolist() == [ref_mbqm(x, multiplier, shift) for x in xs]


@settings(max_examples=300, deadline=None)
@given(real=st.floats(2.0**-31, 1.0), xs=st.lists(int32s, min_size=1, max_size=30))
def test_multiply_is_within_one_of_exact_rounding(real, xs):
    multiplier, shift = quantize_multiplier(real)
    # real close to 1 can round to multiplier 2**30 with shift 1: keep x whose left shift fits
    # int32, since saturating x * 2**shift is the documented (TFLite-compatible) clamp, not error.
    xs = [x for x in xs if abs(x) * 2 ** max(shift, 0) <= INT32_MAX] or [0]
    out = multiply_by_quantized_multiplier(np.array(xs, np.int32), multiplier, shift)
    exact = [round(Fraction(x) * Fraction(real)) for x in xs]
    # Within 1 LSB, not 0: the multiplier carries a <= 2**-31 relative error (< 0.5 LSB for any
    # |x * real| < 2**31), and the result is rounded twice (SRDHM, then RoundingDivideByPOT),
    # with tie rules (half up; half away from zero) that differ from round-half-even.
    assert all(abs(o - e) <= 1 for o, e in zip(out.tolist(), exact, strict=True))


@settings(max_examples=300, deadline=None)
@given(
    real=st.floats(1.0, 2.0**10),
    xs=st.lists(st.integers(-(2**20), 2**20), min_size=1, max_size=30),
)
def test_multiply_left_shift_is_within_one_of_exact_rounding(real, xs):
    multiplier, shift = quantize_multiplier(real)
    out = multiply_by_quantized_multiplier(np.array(xs), multiplier, shift)
    exact = [round(Fraction(x) * Fraction(real)) for x in xs]  # |x * real| < 2**30: no saturation
    assert all(abs(o - e) <= 1 for o, e in zip(out.tolist(), exact, strict=True))


# ------------------------------------------------------------------------------ bias
def test_quantize_bias_golden():
    q = quantize_bias([1.0, -2.0, 0.0625, 3 * 0.03125, 1e10], 0.5, [0.25, 0.125, 0.25, 0.125, 0.5])
    # scales 0.125, 0.0625, 0.0625... : 0.0625/0.125 = 0.5 -> 0 and 0.09375/0.0625 = 1.5 -> 2
    np.testing.assert_array_equal(q, [8, -32, 0, 2, INT32_MAX])
    assert q.dtype == np.int32


def test_bias_scale_is_a_float32_product():
    scale = bias_scale(np.float32(0.1), np.array([0.3, 0.7], np.float32))
    assert scale.dtype == np.float32
    np.testing.assert_array_equal(scale, np.float32(0.1) * np.array([0.3, 0.7], np.float32))
    expected = np.round(np.array([1.0, -1.0]) / scale.astype(np.float64))
    np.testing.assert_array_equal(quantize_bias([1.0, -1.0], 0.1, [0.3, 0.7]), expected)


def test_quantize_bias_per_channel_axis_and_torch_inputs():
    bias = torch.ones(2, 3)
    q = quantize_bias(bias, torch.tensor(0.5), torch.tensor([0.5, 0.25, 0.125]), axis=1)
    np.testing.assert_array_equal(q, [[4, 8, 16], [4, 8, 16]])
    q = quantize_bias(np.ones((2, 3)), 0.5, [0.5, 0.25], axis=0)
    np.testing.assert_array_equal(q, [[4, 4, 4], [8, 8, 8]])


def test_quantize_bias_errors():
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_bias([np.nan], 0.1, 0.1)
    with pytest.raises(ValueError, match="weight_scale must be positive"):
        quantize_bias([1.0], 0.1, [0.0])
    with pytest.raises(ValueError, match="input_scale must hold one element"):
        quantize_bias([1.0], [0.1, 0.2], 0.1)
    with pytest.raises(ValueError, match="underflows"):
        quantize_bias([1.0], 1e-30, 1e-30)
