"""Golden cases for choose_qparams: each formula branch, degenerate and tiny ranges, pow2, errors."""

import numpy as np
import pytest
import torch

from quantbridge.numerics import (
    FALLBACK_SCALE,
    MIN_SCALE,
    PerChannel,
    QScheme,
    choose_qparams,
    pow2_ceil,
    quantize,
)

F32 = np.float32


def test_symmetric_signed_maps_amax_exactly_to_qmax():
    scale, zero_point = choose_qparams(-1.0, 2.0, QScheme())
    assert scale == F32(2.0 / 127) and zero_point == 0
    assert scale.shape == zero_point.shape == () and scale.dtype == F32
    assert zero_point.dtype == np.int32
    assert quantize(np.float32(2.0), scale, zero_point, -128, 127) == 127
    assert quantize(np.float32(-2.0), scale, zero_point, -128, 127) == -127


def test_symmetric_unsigned_uses_the_midpoint():
    scale, zero_point = choose_qparams(-1.0, 2.0, QScheme(signed=False))
    assert zero_point == 128 and scale == F32(2.0 / 127)
    scale, zero_point = choose_qparams(0.0, 2.0, QScheme(signed=False, narrow_range=True))
    assert zero_point == 127 and scale == F32(2.0 / 127)


def test_asymmetric():
    scale, zero_point = choose_qparams(-1.0, 2.0, QScheme(signed=False, symmetric=False))
    assert scale == F32(3.0 / 255) and zero_point == 85  # 0 - round(-1 / (3/255)) = 85
    scale, zero_point = choose_qparams(-1.0, 2.0, QScheme(symmetric=False))
    assert scale == F32(3.0 / 255) and zero_point == -43  # -128 + 85


def test_range_is_extended_to_include_zero():
    assert choose_qparams(1.0, 2.0, QScheme(symmetric=False))[1] == -128  # lo -> 0: z = qmin
    scale, zero_point = choose_qparams(-2.0, -1.0, QScheme(signed=False, symmetric=False))
    assert zero_point == 255 and scale == F32(2.0 / 255)  # hi -> 0: z = qmax


@pytest.mark.parametrize(
    ("scheme", "zero_point"),
    [
        (QScheme(), 0),
        (QScheme(signed=False), 128),
        (QScheme(symmetric=False), -128),
        (QScheme(signed=False, symmetric=False), 0),
        (QScheme(scale_constraint="pow2"), 0),
    ],
)
def test_degenerate_range_falls_back_to_scale_one(scheme, zero_point):
    scale, zp = choose_qparams(0.0, 0.0, scheme)
    assert scale == FALLBACK_SCALE == 1.0 and zp == zero_point


def test_tiny_range_is_clamped_to_min_scale():
    scale, _ = choose_qparams(0.0, 1e-12, QScheme())
    assert scale == F32(MIN_SCALE) == F32(2.0**-23)
    scale, zero_point = choose_qparams(-1e-30, 1e-30, QScheme(symmetric=False))
    assert scale == F32(MIN_SCALE) and zero_point == -128  # recomputed with the clamped scale


def test_pow2_rounds_scale_up_and_recomputes_zero_point():
    scale, _ = choose_qparams(-1.0, 1.0, QScheme(scale_constraint="pow2"))
    assert scale == 2.0**-6  # 1/127 = 0.00787 > 2**-7
    exact = 127 * 2.0**-7
    assert choose_qparams(-exact, exact, QScheme(scale_constraint="pow2"))[0] == 2.0**-7
    scheme = QScheme(signed=False, symmetric=False, scale_constraint="pow2")
    scale, zero_point = choose_qparams(-1.0, 2.0, scheme)
    assert scale == 2.0**-6 and zero_point == 64  # 0 - round(-1 / 2**-6)
    np.testing.assert_array_equal(
        pow2_ceil(np.array([0.75, 1.0, 1.5, 2.0**-30])), [1, 1, 2, 2.0**-30]
    )


def test_per_channel_shapes_and_values():
    scheme = QScheme(granularity=PerChannel(axis=0))
    scale, zero_point = choose_qparams([-1.0, 0.0, -3.0], [0.5, 0.0, 1.0], scheme)
    np.testing.assert_array_equal(scale, np.array([1 / 127, 1.0, 3 / 127], F32))
    np.testing.assert_array_equal(zero_point, [0, 0, 0])
    assert scale.shape == (3,) and zero_point.dtype == np.int32


def test_torch_inputs_are_accepted():
    lo, hi = torch.tensor([-1.0, -2.0]), torch.tensor([1.0, 2.0], requires_grad=True)
    scale, _ = choose_qparams(lo, hi, QScheme(granularity=PerChannel(-1)))
    np.testing.assert_array_equal(scale, np.array([1 / 127, 2 / 127], F32))


def test_non_finite_ranges_name_the_channel():
    scheme = QScheme(granularity=PerChannel(axis=0))
    with pytest.raises(
        ValueError, match=r"non-finite.*channel 1: lo=nan.*channel 2: lo=0.0, hi=inf"
    ):
        choose_qparams([0.0, np.nan, 0.0], [1.0, 1.0, np.inf], scheme)
    with pytest.raises(ValueError, match="non-finite.*lo=-inf"):
        choose_qparams(-np.inf, 1.0, QScheme())


def test_bad_shapes_and_empty_ranges():
    with pytest.raises(ValueError, match="per-tensor scheme needs scalar"):
        choose_qparams([0.0, 1.0], [1.0, 2.0], QScheme())
    with pytest.raises(ValueError, match="per-channel scheme needs 1-D"):
        choose_qparams(0.0, 1.0, QScheme(granularity=PerChannel(0)))
    with pytest.raises(ValueError, match="same shape"):
        choose_qparams([0.0], [1.0, 2.0], QScheme(granularity=PerChannel(0)))
    with pytest.raises(ValueError, match="lo > hi"):
        choose_qparams(2.0, 1.0, QScheme())
    with pytest.raises(ValueError, match="too wide for a float32 scale"):
        choose_qparams(-1e300, 1e300, QScheme())
