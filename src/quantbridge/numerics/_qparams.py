"""Choice of scale and zero point from an observed range ``[lo, hi]`` and a ``QScheme``."""

from __future__ import annotations

import numpy as np

from ._scheme import PerChannel, QScheme
from ._xp import _torch_of

# Smallest scale ever returned: float32 machine epsilon, 2**-23 (the default ``eps`` of
# torch.ao's observers, so both clamp tiny ranges alike). Why a floor at all: a zero or
# subnormal scale makes ``x / scale`` overflow for ordinary inputs and loses precision in
# ``q * scale``. Why this one: it is a power of two (``pow2`` schemes stay exact), its
# reciprocal is exact, and the product of two such scales -- a bias scale
# ``input_scale * weight_scale`` >= 2**-46 -- is still a normal float32, so ``quantize_bias``
# never divides by zero. Ranges narrower than ``qmax * 2**-23`` get a coarser grid than they
# asked for, which still covers them.
MIN_SCALE = 2.0**-23

# Scale used when the range is empty after extension to zero (lo == hi == 0, e.g. an all-zero
# tensor): any positive scale represents it exactly, 1.0 is the conventional choice (ONNX
# Runtime's quantizer uses it too) and keeps scale * code readable.
FALLBACK_SCALE = 1.0


def _as_float64(v: object) -> np.ndarray:
    if _torch_of(v) is not None:
        return v.detach().cpu().double().numpy()
    return np.asarray(v, dtype=np.float64)


def _check_range_arrays(lo: np.ndarray, hi: np.ndarray, scheme: QScheme) -> None:
    if lo.shape != hi.shape:
        raise ValueError(f"lo and hi must have the same shape, got {lo.shape} and {hi.shape}")
    per_channel = isinstance(scheme.granularity, PerChannel)
    if per_channel and lo.ndim != 1:
        raise ValueError(f"per-channel scheme needs 1-D lo/hi (one per channel), got {lo.shape}")
    if not per_channel and lo.ndim != 0:
        raise ValueError(f"per-tensor scheme needs scalar lo/hi, got shape {lo.shape}")
    bad = ~(np.isfinite(lo) & np.isfinite(hi))
    if bad.any():
        if lo.ndim == 0:
            where = f"lo={lo.item()}, hi={hi.item()}"
        else:
            idx = np.flatnonzero(bad)
            where = ", ".join(f"channel {i}: lo={lo[i]}, hi={hi[i]}" for i in idx[:5])
            where += f" ({idx.size} channel(s) in all)" if idx.size > 5 else ""
        raise ValueError(
            f"calibration saw non-finite values (NaN or inf), cannot choose scale: {where}. "
            "Check the calibration data and the model for NaN/inf activations."
        )
    if (lo > hi).any():
        idx = np.flatnonzero(np.atleast_1d(lo > hi))
        raise ValueError(f"empty range lo > hi at index {idx[:5].tolist()}: lo={lo}, hi={hi}")


def pow2_ceil(scale: np.ndarray) -> np.ndarray:
    """Smallest power of two ``>= scale`` (exact, via frexp: ``scale = m * 2**e``, m in [0.5, 1))."""
    mantissa, exponent = np.frexp(scale)
    return np.ldexp(1.0, np.where(mantissa == 0.5, exponent - 1, exponent))


def choose_qparams(lo: object, hi: object, scheme: QScheme) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point covering ``[lo, hi]`` on the grid ``[qmin, qmax]`` of ``scheme``.

    float64 numpy math throughout; returns ``(scale, zero_point)`` as float32 / int32 arrays of
    ``lo``'s shape (``()`` per tensor, ``(C,)`` per channel).

    1. ``lo = min(lo, 0)``, ``hi = max(hi, 0)`` -- zero must be exactly representable;
    2. raw scale, with ``amax = max(-lo, hi)``:

       * symmetric signed:    ``z = 0``, ``s = amax / qmax`` (``+amax`` maps exactly to qmax)
       * symmetric unsigned:  ``z = (qmin + qmax + 1) // 2``, ``s = amax / (qmax - z)``
       * asymmetric:          ``s = (hi - lo) / (qmax - qmin)``

    3. ``lo == hi == 0``: ``s = FALLBACK_SCALE`` (1.0); otherwise ``s = max(s, MIN_SCALE)``
       (2**-23) so a scale is never 0, subnormal or NaN;
    4. ``pow2``: ``s = 2**ceil(log2(s))`` -- rounding up keeps the range covered;
    5. ``s`` is rounded to float32 (exact for pow2);
    6. asymmetric: ``z = clip(qmin - round_half_even(lo / s), qmin, qmax)`` with the final
       float32 ``s``, so the zero point is the one the stored scale implies.

    ValueError for non-finite ``lo``/``hi`` (naming the channel), ``lo > hi``, a shape that
    does not match the granularity, or a range too wide for a float32 scale.
    """
    lo, hi = _as_float64(lo), _as_float64(hi)
    _check_range_arrays(lo, hi, scheme)
    lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
    qmin, qmax = scheme.qmin, scheme.qmax
    if scheme.symmetric:
        zero_point = 0 if scheme.signed else (qmin + qmax + 1) // 2
        scale = np.maximum(-lo, hi) / (qmax - zero_point)
    else:
        scale = (hi - lo) / (qmax - qmin)
    scale = np.where(scale == 0.0, FALLBACK_SCALE, np.maximum(scale, MIN_SCALE))
    if scheme.scale_constraint == "pow2":
        scale = pow2_ceil(scale)
    with np.errstate(over="ignore"):
        scale32 = np.asarray(scale, dtype=np.float32)
    if not np.isfinite(scale32).all():
        raise ValueError(f"range [{lo}, {hi}] is too wide for a float32 scale")
    if scheme.symmetric:
        zero_point = np.full(lo.shape, zero_point, dtype=np.int32)
    else:
        zero_point = np.clip(qmin - np.round(lo / scale32.astype(np.float64)), qmin, qmax)
        zero_point = np.asarray(zero_point, dtype=np.int32)
    return scale32, zero_point
