"""Golden edge cases for quantize / dequantize / fake_quantize: ties, saturation, NaN, grids,
per-channel axes, and the numpy/torch contract (same bits, numpy path never imports torch)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from quantbridge.numerics import QScheme, dequantize, fake_quantize, quantize

F32 = np.float32
INT8 = (-128, 127)


@pytest.mark.parametrize("scale", [0.25, 3.0, 1.0])  # scales for which k + 0.5 steps are exact
@pytest.mark.parametrize("zero_point", [0, 3, -7])
def test_ties_round_half_to_even(scale, zero_point):
    steps = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5], F32)
    expected = np.array([0, 2, 2, 0, -2, -2, 4, -4], F32) + zero_point
    q = quantize(steps * F32(scale), scale, zero_point, *INT8)
    np.testing.assert_array_equal(q, expected)
    assert q.dtype == F32


@pytest.mark.parametrize(
    ("qmin", "qmax", "zero_point"),
    [(-128, 127, 0), (-127, 127, 0), (0, 255, 128), (0, 254, 17), (-32768, 32767, -5), (-8, 7, 2)],
)
def test_saturation_in_wide_type(qmin, qmax, zero_point):
    x = np.array([np.inf, -np.inf, 3e9, -3e9, F32(np.finfo(F32).max), -1e38], F32)
    q = quantize(x, F32(0.01), zero_point, qmin, qmax)
    np.testing.assert_array_equal(q, [qmax, qmin, qmax, qmin, qmax, qmin])


@pytest.mark.parametrize("zero_point", [0, 5, 128])
def test_nan_maps_to_zero_point(zero_point):
    x = np.array([np.nan, 1.0, -np.nan], F32)
    q = quantize(x, 0.5, zero_point, 0, 255)
    np.testing.assert_array_equal(q, [zero_point, zero_point + 2, zero_point])
    np.testing.assert_array_equal(fake_quantize(x, 0.5, zero_point, 0, 255), [0.0, 1.0, 0.0])


def test_narrow_range_drops_the_most_negative_code():
    scheme = QScheme(narrow_range=True)
    x = np.array([-1e9, -127.0, -126.6, 127.4, 1e9], F32)
    q = quantize(x, 1.0, 0, scheme.qmin, scheme.qmax)
    np.testing.assert_array_equal(q, [-127, -127, -127, 127, 127])


@pytest.mark.parametrize("bits", range(2, 17))
@pytest.mark.parametrize("signed", [True, False])
def test_every_bit_width_saturates_at_its_grid(bits, signed):
    scheme = QScheme(bits=bits, signed=signed)
    x = np.array([-np.inf, -3e9, scheme.qmin, 0, scheme.qmax, 3e9, np.inf], F32)
    q = quantize(x, 1.0, 0, scheme.qmin, scheme.qmax)
    qmin, qmax = scheme.qmin, scheme.qmax
    np.testing.assert_array_equal(q, [qmin, qmin, qmin, 0, qmax, qmax, qmax])


def test_dequantize_formula_and_dtypes():
    q = np.array([-128, 0, 5, 127], np.int8)
    r = dequantize(q, F32(0.1), 5)
    np.testing.assert_array_equal(r, (q.astype(F32) - F32(5)) * F32(0.1))
    assert r.dtype == F32
    assert dequantize(q.astype(np.float64), 0.1, 5).dtype == np.float64
    assert dequantize(np.array([3], np.uint16), 1.0, 0).dtype == F32
    assert quantize(np.array([1.0], np.float16), 1.0, 0, *INT8).dtype == F32
    assert quantize([1.0, 2.0], 1.0, 0, *INT8).dtype == F32


def _loop_reference(fn, x, scale, zero_point, axis, *args):
    """Per-channel result assembled channel by channel from the per-tensor function."""
    moved = np.moveaxis(x, axis, 0)
    out = [fn(moved[c], scale[c], zero_point[c], *args) for c in range(moved.shape[0])]
    return np.moveaxis(np.stack(out), 0, axis)


@pytest.mark.parametrize("axis", [0, 1, -1, 2])
def test_per_channel_matches_per_tensor_loop(axis):
    rng = np.random.default_rng(axis + 10)
    x = (rng.standard_normal((3, 4, 5)) * 4).astype(F32)
    channels = x.shape[axis]
    scale = rng.uniform(0.01, 0.2, channels).astype(F32)
    zero_point = rng.integers(-20, 20, channels).astype(np.int8)
    q = quantize(x, scale, zero_point, *INT8, axis=axis)
    np.testing.assert_array_equal(q, _loop_reference(quantize, x, scale, zero_point, axis, *INT8))
    r = dequantize(q, scale, zero_point, axis=axis)
    np.testing.assert_array_equal(r, _loop_reference(dequantize, q, scale, zero_point, axis))
    np.testing.assert_array_equal(fake_quantize(x, scale, zero_point, *INT8, axis=axis), r)


def test_per_channel_accepts_one_element_params_and_rejects_bad_shapes():
    x = np.ones((2, 3), F32)
    np.testing.assert_array_equal(quantize(x, [0.5], [1], *INT8, axis=1), np.full((2, 3), 3.0))
    with pytest.raises(ValueError, match="length 3"):
        quantize(x, [0.5, 0.5], 0, *INT8, axis=1)
    with pytest.raises(ValueError, match="axis=None"):
        quantize(x, [0.5, 0.5], 0, *INT8)
    with pytest.raises(ValueError, match="out of range"):
        quantize(x, [0.5, 0.5], 0, *INT8, axis=2)
    with pytest.raises(ValueError, match="qmin <= qmax"):
        quantize(x, 0.5, 0, 5, 4)


# ------------------------------------------------------------------ numpy vs torch, bit for bit
def _edge_data(rng, shape):
    x = (rng.standard_normal(shape) * 50).astype(F32)
    flat = x.reshape(-1)
    edges = [np.inf, -np.inf, np.nan, 3e9, -3e9, 0.0, -0.0, 1e-45, 0.125, -0.375, 2.5]
    flat[: len(edges)] = edges
    return x


def _bits(a):
    a = a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return a.view(np.uint32 if a.dtype == F32 else np.uint64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("axis", [None, 0, -1])
def test_numpy_and_torch_agree_bit_for_bit(dtype, axis):
    rng = np.random.default_rng(7)
    x = _edge_data(rng, (6, 5, 4)).astype(dtype)
    n = 1 if axis is None else x.shape[axis]
    scale = rng.uniform(0.05, 2.0, n).astype(F32)
    zero_point = rng.integers(0, 256, n).astype(np.uint8)
    if axis is None:
        scale, zero_point = scale[0], zero_point[0]
    args = (0, 255, axis)
    q_np = quantize(x, scale, zero_point, *args)
    q_t = quantize(torch.from_numpy(x), torch.as_tensor(scale), torch.as_tensor(zero_point), *args)
    assert isinstance(q_t, torch.Tensor) and q_t.dtype == torch.from_numpy(x).dtype
    np.testing.assert_array_equal(_bits(q_np), _bits(q_t))
    codes = q_np.astype(np.uint8)
    d_np = dequantize(codes, scale, zero_point, axis)
    d_t = dequantize(torch.from_numpy(codes), scale, zero_point, axis)
    np.testing.assert_array_equal(_bits(d_np), _bits(d_t))
    f_np = fake_quantize(x, scale, zero_point, *args)
    f_t = fake_quantize(torch.from_numpy(x), scale, zero_point, *args)
    np.testing.assert_array_equal(_bits(f_np), _bits(f_t))


def test_numerics_imports_without_torch():
    """The numerics modules never import torch. The top-level ``quantbridge/__init__`` may (it
    re-exports the torch layer), so the parent package is replaced by a bare namespace here."""
    pkg_dir = os.path.join(os.path.dirname(__file__), "..", "..", "src", "quantbridge")
    code = (
        "import sys, types, numpy as np\n"
        "pkg = types.ModuleType('quantbridge'); pkg.__path__ = [sys.argv[1]]\n"
        "sys.modules['quantbridge'] = pkg\n"
        "import quantbridge.numerics as n\n"
        "n.fake_quantize(np.ones(3, np.float32), 0.1, 0, -128, 127)\n"
        "n.choose_qparams(-1.0, 1.0, n.QScheme())\n"
        "assert 'torch' not in sys.modules, 'numerics imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code, os.path.abspath(pkg_dir)], check=True)
