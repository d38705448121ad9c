"""Per-channel weight ranges by weighted squared rounding error (symmetric signed grids).

A layer's output error from its weight rounding, for output channel ``i`` with the weight row
``w_i`` and rounding error ``e_i = w_i - fq(w_i)``, is ``E[(e_i . x)^2] = e_i^T E[x x^T] e_i``
over the layer's inputs ``x`` (a conv's im2col patches). Keeping only the diagonal of the
second moment (the inputs' cross terms; exact when the inputs are uncorrelated and centred
terms cancel, and the usual diagonal-Hessian approximation otherwise):

.. math:: \\mathrm{err}_i(s) = \\sum_j d_j \\, (w_{ij} - \\mathrm{fq}(w_{ij}; s))^2,
          \\qquad d_j = E[x_j^2]

``d = 1`` everywhere is the plain squared weight error. With ``d_j = Var(x_j)`` it is the
variance of that output error (the part a bias correction, which removes its mean, leaves). The scale of channel ``i`` is chosen among
``s = r * max_j |w_ij| / qmax`` for the clip ratios ``r``: the smallest error wins, ties go to the
larger ratio (the wider grid, so ``r = 1``, the min-max scale, wins whenever nothing is better).
"""

from __future__ import annotations

import numpy as np

from ._affine import fake_quantize
from ._qparams import MIN_SCALE

# clip ratios tried by default: 1.0 down to 0.5 in steps of 0.0125 (41 values)
DEFAULT_RATIOS = tuple(float(r) for r in np.linspace(1.0, 0.5, 41))


def weighted_rounding_error(
    w: np.ndarray, scale: np.ndarray, qmin: int, qmax: int, importance: np.ndarray
) -> np.ndarray:
    """``err_i = sum_j d_j (w_ij - fq(w_ij))^2`` per row ``i`` of the 2-D ``w`` (channels,
    fan-in), ``fq`` = ``fake_quantize`` at ``scale[i]`` with zero point 0 on ``[qmin, qmax]``
    (its rounding: half to even, in float64 here), ``importance`` ``d`` broadcastable to ``w``
    (a row per channel for a grouped conv, whose channels read different inputs). float64."""
    w = np.asarray(w, dtype=np.float64)
    scale = np.asarray(scale, dtype=np.float64)
    zero = np.zeros(scale.shape, dtype=np.float64)
    err = w - fake_quantize(w, scale, zero, qmin, qmax, axis=0)
    return (np.asarray(importance, dtype=np.float64) * err * err).sum(axis=1)


def weighted_mse_scales(
    w: np.ndarray,
    qmin: int,
    qmax: int,
    importance: np.ndarray | None = None,
    ratios: tuple[float, ...] = DEFAULT_RATIOS,
) -> np.ndarray:
    """Per row of the 2-D ``w`` the scale ``r * max|w_i| / qmax`` (``r`` in ``ratios``) with the
    least ``weighted_rounding_error`` (module docstring); ``importance`` ``None`` = 1. Ties: the
    earlier ratio in ``ratios`` (the default list runs from 1.0 down). An all-zero row gets
    ``MIN_SCALE`` (any scale represents it). Returns float32 scales, as ``choose_qparams`` does;
    the error is evaluated at the float32 scale that is returned."""
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(
            f"weighted_mse_scales takes a 2-D weight (channels, fan-in), got {w.shape}"
        )
    d = np.ones_like(w) if importance is None else np.asarray(importance, dtype=np.float64)
    if np.any(d < 0) or not np.all(np.isfinite(d)):
        raise ValueError("importance (E[x^2] per input) must be finite and >= 0")
    return best_channel_scales(
        np.abs(w).max(axis=1), ratios, qmax, lambda s: weighted_rounding_error(w, s, qmin, qmax, d)
    )


def best_channel_scales(amax: np.ndarray, ratios, qmax: int, error) -> np.ndarray:
    """Per output channel, the scale ``max(amax r / qmax, MIN_SCALE)`` (float32) over ``ratios``
    with the least ``error(scale)`` (one error per channel); the first ratio wins ties."""
    best_scale = best_err = None
    for r in ratios:
        scale = np.maximum(amax * float(r) / qmax, MIN_SCALE).astype(np.float32)
        err = error(scale)
        if best_err is None:
            best_scale, best_err = scale, err
            continue
        better = err < best_err
        best_scale = np.where(better, scale, best_scale)
        best_err = np.where(better, err, best_err)
    return np.asarray(best_scale, dtype=np.float32)
