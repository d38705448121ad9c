"""Hypothesis property tests of quantize / fake_quantize / choose_qparams against one-line
float64 references, plus numpy/torch bit equality on arbitrary float32 data."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from quantbridge.numerics import (
    MIN_SCALE,
    PerChannel,
    QScheme,
    choose_qparams,
    dequantize,
    fake_quantize,
    quantize,
)

F32 = np.float32
# float32 rounding slack: x / s and (q - z) * s are each rounded once to float32 (relative error
# <= 2**-24 each); 2**-22 relative to max(|x|, s) covers both with a factor 2 to spare.
SLACK = 2.0**-22

schemes = st.builds(
    QScheme,
    bits=st.integers(2, 16),
    signed=st.booleans(),
    symmetric=st.booleans(),
    narrow_range=st.booleans(),
    scale_constraint=st.sampled_from(["float", "pow2"]),
)
finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)
ranges = st.tuples(finite, finite).map(sorted)


@settings(max_examples=300, deadline=None)
@given(scheme=schemes, lohi=ranges, fractions=st.lists(st.floats(0, 1), min_size=1, max_size=20))
def test_fake_quantize_error_is_half_a_step_inside_the_range(scheme, lohi, fractions):
    lo, hi = min(lohi[0], 0.0), max(lohi[1], 0.0)
    scale, zero_point = choose_qparams(lohi[0], lohi[1], scheme)
    x = np.array([lo + f * (hi - lo) for f in fractions] + [lo, hi, 0.0], F32)
    x = np.clip(x, lo, hi)  # float32 rounding of lo + f * (hi - lo) must not leave [lo, hi]
    err = np.abs(fake_quantize(x, scale, zero_point, scheme.qmin, scheme.qmax) - x.astype(float))
    # 0.5 LSB: round-to-nearest inside the grid; choose_qparams guarantees [lo, hi] is inside
    # the grid up to half a step at each end, so saturation never costs more than that either.
    bound = 0.5 * float(scale) + SLACK * np.maximum(np.abs(x), float(scale))
    assert (err <= bound).all(), (err / scale, x)
    assert fake_quantize(np.zeros(1, F32), scale, zero_point, scheme.qmin, scheme.qmax)[0] == 0


@settings(max_examples=300, deadline=None)
@given(scheme=schemes, lohi=ranges)
def test_choose_qparams_covers_the_range(scheme, lohi):
    lo, hi = min(lohi[0], 0.0), max(lohi[1], 0.0)
    scale, zero_point = choose_qparams(lohi[0], lohi[1], scheme)
    s, z = float(scale), int(zero_point)
    assert scale.dtype == F32 and zero_point.dtype == np.int32 and scale.shape == ()
    assert s >= MIN_SCALE and np.isfinite(s)
    assert scheme.qmin <= z <= scheme.qmax  # zero is exactly representable: it is code z
    tol = SLACK * max(hi - lo, s)  # float32 rounding of the stored scale
    assert (scheme.qmin - z) * s <= lo + 0.5 * s + tol
    assert (scheme.qmax - z) * s >= hi - 0.5 * s - tol
    if scheme.symmetric:
        assert z == (0 if scheme.signed else (scheme.qmin + scheme.qmax + 1) // 2)
    if scheme.scale_constraint == "pow2":
        mantissa, _ = np.frexp(s)
        assert mantissa == 0.5  # an exact power of two
        float_scheme = QScheme(**{**scheme.__dict__, "scale_constraint": "float"})
        s_float = float(choose_qparams(lohi[0], lohi[1], float_scheme)[0])
        assert s_float * (1 - SLACK) <= s < 2 * s_float * (1 + SLACK)


@settings(max_examples=100, deadline=None)
@given(
    lo=arrays(np.float64, 5, elements=finite),
    hi=arrays(np.float64, 5, elements=finite),
    scheme=schemes,
)
def test_per_channel_qparams_equal_per_tensor_ones(lo, hi, scheme):
    lo, hi = np.minimum(lo, hi), np.maximum(lo, hi)
    per_channel = QScheme(**{**scheme.__dict__, "granularity": PerChannel(0)})
    scale, zero_point = choose_qparams(lo, hi, per_channel)
    assert scale.shape == zero_point.shape == (5,)
    for c in range(5):
        s, z = choose_qparams(lo[c], hi[c], scheme)
        assert scale[c] == s and zero_point[c] == z


@settings(max_examples=300, deadline=None)
@given(
    x=arrays(F32, st.integers(1, 40), elements=st.floats(width=32, allow_nan=False)),
    scale=st.floats(2.0**-20, 2.0**20, width=32),
    zero_point=st.integers(-128, 127),
)
def test_quantize_equals_float64_reference(x, scale, zero_point):
    # Reference: the division rounded to float32 (as ONNX does; float64 division of float32
    # operands rounded to float32 is the correctly rounded float32 quotient), the rest in float64.
    with np.errstate(over="ignore", invalid="ignore"):
        t = (x.astype(np.float64) / scale).astype(F32).astype(np.float64)
    expected = np.clip(np.round(t) + zero_point, -128, 127)
    np.testing.assert_array_equal(quantize(x, scale, zero_point, -128, 127), expected)


def _bits(a):
    a = a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return a.view(np.uint32)


@settings(max_examples=200, deadline=None)
@given(
    x=arrays(F32, st.integers(1, 64), elements=st.floats(width=32)),
    scale=st.floats(2.0**-30, 2.0**30, width=32),
    zero_point=st.integers(0, 255),
)
def test_numpy_and_torch_agree_bit_for_bit(x, scale, zero_point):
    x_t = torch.from_numpy(x)
    for fn in (quantize, fake_quantize):
        np.testing.assert_array_equal(
            _bits(fn(x, scale, zero_point, 0, 255)), _bits(fn(x_t, scale, zero_point, 0, 255))
        )
    q = quantize(x, scale, zero_point, 0, 255).astype(np.uint8)
    np.testing.assert_array_equal(
        _bits(dequantize(q, scale, zero_point)),
        _bits(dequantize(torch.from_numpy(q), scale, zero_point)),
    )


@settings(max_examples=300, deadline=None)
@given(
    x=arrays(F32, (3, 5), elements=st.floats(width=32)),  # NaN, +-inf, -0.0, 3e38 included
    scale=arrays(F32, 3, elements=st.floats(2.0**-30, 2.0**30, width=32)),
    zero_point=arrays(np.int32, 3, elements=st.integers(-128, 255)),
    per_channel=st.booleans(),
    signed=st.booleans(),
)
def test_fake_quantize_is_dequantize_of_quantize_bit_for_bit(
    x, scale, zero_point, per_channel, signed
):
    # fake_quantize dequantizes in place on quantize's fresh codes, and quantize maps NaN -> 0
    # after the division (in place, no copy of the input): the result must be the composition's
    # to the bit, +0.0 for a zero code included (no -0.0).
    qmin, qmax = (-128, 127) if signed else (0, 255)
    zero_point = np.clip(zero_point, qmin, qmax).astype(F32)
    axis, s, z = (0, scale, zero_point) if per_channel else (None, scale[0], zero_point[0])
    for xs in (x, torch.from_numpy(x)):
        expected = dequantize(quantize(xs, s, z, qmin, qmax, axis), s, z, axis)
        np.testing.assert_array_equal(
            _bits(fake_quantize(xs, s, z, qmin, qmax, axis)), _bits(expected)
        )


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_fake_quantize_traces_with_fake_tensors(mode):
    """Tracing (fake or symbolic tensors, as torch.export and torch.compile do) takes the
    composition, not the per-tensor CPU path, which reads the scale as a Python number: the
    traced graph gives the eager result to the bit."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.linspace(-3.0, 3.0, 97).reshape(1, 97)
    scale, zero_point = torch.tensor(0.05), torch.tensor(7.0)

    def fq(t, s, z):
        return fake_quantize(t, s, z, 0, 255)

    graph = make_fx(fq, tracing_mode=mode)(x, scale, zero_point)
    np.testing.assert_array_equal(
        _bits(graph(x, scale, zero_point)), _bits(fq(x, scale, zero_point))
    )
