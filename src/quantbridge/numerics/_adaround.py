"""AdaRound's rounding formulas (Nagel et al. 2020, "Up or Down? Adaptive Rounding for
Post-Training Quantization"): a per-weight choice between ``floor`` and ``floor + 1``.

Instead of ``round(w / s)`` each weight takes

.. math:: q = \\mathrm{clip}(\\lfloor w / s \\rfloor + h + z,\\ q_{min},\\ q_{max})

with ``h`` in ``[0, 1]``: soft (``h = h(V)``, the rectified sigmoid of a learned ``V``) while the
rounding is learned, hard (``h = 1 if V >= 0 else 0``, ``hard_rounding``) once it is set. Every hard code is thus
``floor(w / s)`` or ``ceil(w / s)`` (plus the zero point), saturated to the grid like ``quantize``.
The same order of operations as ``quantize``: ``w / s`` is one correctly rounded IEEE division in
the compute dtype, then ``floor``, ``+ h``, ``+ z``, clip (saturation in the float type).

One implementation for numpy arrays and torch tensors (``_xp``); with torch tensors the soft form
is differentiable in ``h`` (``floor`` of the weight is a constant, the clip passes the gradient
inside the grid and zeroes it outside).
"""

from __future__ import annotations

import math

import numpy as np

from ._affine import _check_range
from ._xp import Array, _xp, as_compute_float, as_like, broadcast_param

ZETA = 1.1  # stretch of the rectified sigmoid (the paper's zeta, gamma)
GAMMA = -0.1


def rectified_sigmoid(v: Array, zeta: float = ZETA, gamma: float = GAMMA) -> Array:
    """``h(V) = clip(sigmoid(V) * (zeta - gamma) + gamma, 0, 1)``: reaches 0 and 1 exactly at
    finite ``V`` (the plain sigmoid only tends to them), so learned roundings can become hard."""
    xp = _xp(v)
    sig = 1.0 / (1.0 + xp.exp(-v))
    return xp.clip(sig * (zeta - gamma) + gamma, 0.0, 1.0)


def rectified_sigmoid_inverse(h: Array, zeta: float = ZETA, gamma: float = GAMMA) -> Array:
    """``V`` with ``h(V) = h`` for ``h`` in ``[0, 1)``: ``V = -log((zeta - gamma) / (h - gamma) - 1)``.

    AdaRound starts from ``h = frac(w / s)``, so the soft weight at step 0 is the float weight
    (inside the grid). Finite for every ``h`` in ``[0, 1]``, since ``0 < h - gamma <= 1 - gamma <
    zeta - gamma``."""
    xp = _xp(h)
    return -xp.log((zeta - gamma) / (h - gamma) - 1.0)


def rounding_regularizer(h: Array, beta: float) -> Array:
    """``mean(1 - |2h - 1| ** beta)``: 0 when every ``h`` is 0 or 1, up to 1 when all are 0.5.

    The paper sums over weights; the mean keeps one regularisation weight meaningful for layers of
    any size. A large ``beta`` (20) leaves ``h`` free except near 0.5; annealing it to 2 pushes
    every ``h`` to 0 or 1."""
    xp = _xp(h)
    return (1.0 - xp.abs(2.0 * h - 1.0) ** beta).mean()


def beta_schedule(step: int, steps: int, start: float, end: float, warmup: float) -> float:
    """The regulariser's ``beta`` at ``step`` of ``steps``: ``start`` during the first ``warmup``
    fraction (the regulariser is off then, see ``adaround_quantize``'s caller), then linear down to
    ``end`` at the last step (as the paper's reference implementation anneals it)."""
    first = math.floor(warmup * steps)
    if step < first or steps - first <= 1:
        return float(start)
    t = (step - first) / (steps - first - 1)
    return float(start + (end - start) * t)


def floor_codes(x: Array, scale: Array, axis: int | None = None) -> tuple[Array, Array]:
    """``(floor(x / s), x / s - floor(x / s))`` in the compute dtype: the rounding-down code
    (before the zero point) and the fraction AdaRound starts ``h`` from, in ``[0, 1]`` (1.0 where
    a tiny negative quotient rounds: ``-1e-38 - (-1)``; NaN for infinite ``x``)."""
    x = as_compute_float(x)
    xp = _xp(x)
    scale = broadcast_param(as_like(scale, x), "scale", tuple(x.shape), axis)
    with np.errstate(over="ignore", invalid="ignore"):  # +-inf: saturates later, fraction NaN
        t = x / scale
        down = xp.floor(t)
        return down, t - down


def hard_rounding(v: Array, frac: Array) -> Array:
    """The learned rounding made hard: ``1.0`` (round up) where ``V >= 0`` and ``w / s`` is not
    already an integer, else ``0.0``. With ``down = floor(w / s)`` the code ``down + up`` is then
    ``floor(w / s)`` or ``ceil(w / s)``; never ``w / s + 1`` for an integer ``w / s``."""
    xp = _xp(v)
    return xp.where((v >= 0) & (frac > 0), 1.0, 0.0)


def adaround_quantize(
    down: Array,
    up: Array,
    zero_point: Array,
    qmin: int,
    qmax: int,
    axis: int | None = None,
) -> Array:
    """Codes ``clip(down + up + z, qmin, qmax)`` (floats), ``down = floor(w / s)`` from
    ``floor_codes``, ``up`` in ``[0, 1]`` (soft) or ``{0, 1}`` (hard). ``dequantize`` maps them
    back to weights; with a hard ``up`` the result is an exact grid point that ``quantize``
    returns unchanged."""
    _check_range(qmin, qmax)
    xp = _xp(down)
    zero_point = broadcast_param(as_like(zero_point, down), "zero_point", tuple(down.shape), axis)
    return xp.clip(down + up + zero_point, int(qmin), int(qmax))
