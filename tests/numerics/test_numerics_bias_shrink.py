"""``numerics.shrink_bias_shift``: a bias correction shrunk by its own calibration noise."""

from __future__ import annotations

import numpy as np
import pytest

from quantbridge.numerics import shrink_bias_shift


def _reference(errors: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The docstring's formula, one channel at a time in Python float64 sums."""
    out = []
    for ch in range(errors.shape[1]):
        pairs = [(float(errors[n, ch]), float(counts[n])) for n in range(errors.shape[0])]
        pairs = [(e, w) for e, w in pairs if w > 0]
        total = sum(w for _, w in pairs)
        c = sum(w * e for e, w in pairs) / total
        n = len(pairs)
        se2 = n / (n - 1) * sum(w * w * (e - c) ** 2 for e, w in pairs) / total**2
        out.append(c**3 / (c**2 + se2))
    return np.array(out)


def test_shrunk_shift_matches_a_float64_recomputation():
    # unequal counts (masked tokens), one sample with none; float64 both ways, so equal up to
    # summation order (1e-12 relative: a few ulp of ~20 terms)
    rng = np.random.default_rng(0)
    errors = rng.normal(0.3, 1.0, (9, 7)) * rng.uniform(0.1, 3.0, 7)
    counts = np.array([5, 1, 8, 0, 3, 3, 12, 2, 7], dtype=np.float64)
    got = shrink_bias_shift(errors.astype(np.float32), counts)
    np.testing.assert_allclose(got, _reference(errors.astype(np.float32), counts), rtol=1e-12)
    # equal counts: se^2 is the sample variance over N
    equal = shrink_bias_shift(errors, np.ones(9))
    c, se2 = errors.mean(0), errors.var(0, ddof=1) / 9
    np.testing.assert_allclose(equal, c * c * c / (c * c + se2), rtol=1e-12)


def test_pure_noise_shrinks_and_a_consistent_error_is_kept():
    rng = np.random.default_rng(1)
    samples, channels = 16, 20000
    noise = rng.normal(0.0, 1.0, (samples, channels))
    plain = noise.mean(0)
    shrunk = shrink_bias_shift(noise, np.full(samples, 64.0))
    # pure noise (true mean 0): the plain correction's squared error is se^2 on average; the
    # shrunk one's 0.47 se^2 with a known se (docstring), a little more with se estimated from
    # 16 samples (measured 0.50); 20000 channels: the ratio's sampling error is ~1 %
    ratio = float((shrunk**2).mean() / (plain**2).mean())
    assert 0.40 < ratio < 0.60, ratio
    assert np.all(np.abs(shrunk) <= np.abs(plain))
    # a consistent error 100 se away: the shift is the plain correction to (se / c)^2 ~ 1e-4
    consistent = 25.0 * np.sign(rng.normal(size=channels)) + noise
    got = shrink_bias_shift(consistent, np.full(samples, 64.0))
    np.testing.assert_allclose(got, consistent.mean(0), rtol=1e-3)


def test_degenerate_inputs():
    # one sample: no noise estimate, the plain correction; no error at all: 0, not NaN
    e = np.array([[0.5, -2.0, 0.0]])
    np.testing.assert_array_equal(shrink_bias_shift(e, np.array([3.0])), e[0])
    np.testing.assert_array_equal(shrink_bias_shift(np.zeros((4, 2)), np.ones(4)), np.zeros(2))
    with pytest.raises(ValueError, match="samples, channels"):
        shrink_bias_shift(np.zeros(3), np.ones(3))
    with pytest.raises(ValueError, match="counts sum to 0"):
        shrink_bias_shift(np.ones((2, 2)), np.zeros(2))
