"""MSE calibration: the range minimising the expected quantize-dequantize squared error.

Error model. Given a candidate range, ``choose_qparams`` gives ``s`` and ``z``; the grid is
``s u`` for integers ``u`` in ``[u_lo, u_hi] = [qmin - z, qmax - z]`` and
:math:`\\hat x = s\\,\\mathrm{clip}(\\mathrm{round}(x/s), u_{lo}, u_{hi})` (the formula of
``numerics.fake_quantize``). Within each histogram bin the values are taken as uniformly
spread, so the bin's expected error is an exact integral, via the closed-form antiderivative

.. math:: E(x) = \\int_0^x (\\hat t - t)^2\\,dt
          = s^3 \\Big(\\frac{r}{12} + \\frac{(v - r)^3}{3}\\Big) + \\frac{(x - s v)^3}{3},
          \\qquad v = \\mathrm{clip}(x/s, u_{lo}, u_{hi}),\\ r = \\mathrm{round}(v)

(each full step contributes :math:`s^3/12`; beyond the grid the error is the clipping
distance). A bin ``[e_j, e_{j+1})`` holding ``c_j`` values contributes
:math:`c_j (E(e_{j+1}) - E(e_j)) / (e_{j+1} - e_j)`; the outermost edges are moved in to the exact
``min`` / ``max`` when that keeps the bin non-empty. Ties in rounding have measure zero.
Everything the scheme implies -- bits, narrow range, zero point rounding, ``pow2`` scales -- is
modelled, because the actual ``choose_qparams`` output is used. The scheme is given to
``range(scheme)`` (required).

Search (candidate thresholds ``T_k = k w`` and ``max|x|``; range ``[max(min, -T), min(max, T)]``):

1. one-parameter search over ``T``: coarse pass over 128 evenly spaced candidates, then every
   candidate between the neighbours of the 3 best coarse ones (exact where the error curve
   is unimodal between coarse points; the data's extremes are always candidates);
2. asymmetric schemes only: coordinate descent, 2 rounds: ``lo`` over ``{-k w} U {min}`` with
   ``hi`` fixed, then ``hi`` over ``{k w} U {max}`` with ``lo`` fixed, same coarse-to-fine search;
   a move is kept only if it lowers the error, so the result is never worse than step 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from quantbridge.numerics import PerChannel, QScheme, choose_qparams

from ._histogram import (
    Histogram,
    HistogramObserver,
    bin_of,
    clipped_range,
    threshold_grid,
)
from ._registry import register_observer

_COARSE = 128
_REFINE_BEST = 3
_DESCENT_ROUNDS = 2
_MAX_CHUNK_ELEMENTS = 1 << 22


def cumulative_squared_error(
    x: np.ndarray, scale: np.ndarray, u_lo: np.ndarray, u_hi: np.ndarray
) -> np.ndarray:
    """``E(x)``: integral from 0 to ``x`` of the squared fake-quantization error (broadcasts)."""
    v = np.clip(x / scale, u_lo, u_hi)
    tail = scale * v
    np.subtract(x, tail, out=tail)  # clipping distance, 0 inside the grid
    rounded = np.round(v)
    frac = np.subtract(v, rounded, out=v)
    # s^3 (r/12 + frac^3/3) + tail^3/3, with few temporaries (this is the hot loop)
    result = np.multiply(frac, frac)
    result *= frac
    result *= 4.0
    result += rounded
    result *= scale * scale * scale / 12.0
    np.multiply(tail, tail, out=rounded)
    rounded *= tail
    rounded *= 1.0 / 3.0
    result += rounded
    return result


class ErrorModel:
    """Expected sum of squared errors of a histogram under candidate ranges of one scheme."""

    def __init__(self, hist: Histogram, scheme: QScheme) -> None:
        first, last = bin_of(hist, hist.min), bin_of(hist, hist.max)
        self.counts = hist.counts[first : last + 1].astype(np.float64)
        edges = -hist.half_range + np.arange(first, last + 2) * hist.bin_width
        edges[0] = hist.min
        if hist.max > edges[-2]:
            edges[-1] = hist.max
        self.edges = edges
        self.widths = np.diff(edges)
        self.scheme = dataclasses.replace(scheme, granularity=PerChannel(0))

    def sse(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Expected squared error summed over all values, for each range ``(lo[i], hi[i])``."""
        lo, hi = np.broadcast_arrays(np.atleast_1d(lo), np.atleast_1d(hi))
        chunk = max(1, _MAX_CHUNK_ELEMENTS // self.edges.size)
        return np.concatenate(
            [
                self._sse_chunk(lo[i : i + chunk], hi[i : i + chunk])
                for i in range(0, lo.size, chunk)
            ]
        )

    def _sse_chunk(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        scale, zero_point = choose_qparams(lo, hi, self.scheme)
        scale = scale.astype(np.float64)[:, None]
        zero_point = zero_point.astype(np.float64)[:, None]
        u_lo, u_hi = self.scheme.qmin - zero_point, self.scheme.qmax - zero_point
        cumulative = cumulative_squared_error(self.edges[None, :], scale, u_lo, u_hi)
        return (np.diff(cumulative, axis=1) / self.widths) @ self.counts


def search_1d(
    values: np.ndarray, evaluate: Callable[[np.ndarray], np.ndarray]
) -> tuple[float, float]:
    """``(value, error)`` minimising ``evaluate`` over sorted ``values``, coarse to fine."""
    if values.size <= 2 * _COARSE:
        errors = evaluate(values)
        best = int(np.argmin(errors))
        return float(values[best]), float(errors[best])
    coarse = np.unique(np.round(np.linspace(0, values.size - 1, _COARSE)).astype(np.int64))
    coarse_errors = evaluate(values[coarse])
    windows = []
    for i in np.argsort(coarse_errors, kind="stable")[:_REFINE_BEST]:
        start = coarse[max(i - 1, 0)]
        stop = coarse[min(i + 1, coarse.size - 1)]
        windows.append(np.arange(start, stop + 1))
    fine = np.unique(np.concatenate(windows))
    errors = evaluate(values[fine])
    best = int(np.argmin(errors))
    return float(values[fine[best]]), float(errors[best])


def _descend(
    model: ErrorModel, hist: Histogram, lo: float, hi: float, error: float
) -> tuple[float, float]:
    """Coordinate descent on ``lo`` and ``hi`` separately (asymmetric schemes)."""
    steps = np.arange(0, np.floor(max(-hist.min, hist.max) / hist.bin_width) + 2) * hist.bin_width
    lo_values = np.unique(np.append(np.maximum(hist.min, -steps), lo))
    hi_values = np.unique(np.append(np.minimum(hist.max, steps), hi))
    for _ in range(_DESCENT_ROUNDS):
        moved = False
        # never the empty range (0, 0): choose_qparams' fallback scale 1.0, not a grid the data
        # chose (it won on integer data 0..9, which scale 1 holds exactly, and read as dead)
        candidates = lo_values[(lo_values <= hi) & ((lo_values != 0.0) | (hi != 0.0))]
        new_lo, new_error = search_1d(
            candidates, lambda v, hi=hi: model.sse(v, np.full_like(v, hi))
        )
        if new_error < error:
            lo, error, moved = new_lo, new_error, moved or new_lo != lo
        candidates = hi_values[(hi_values >= lo) & ((hi_values != 0.0) | (lo != 0.0))]
        new_hi, new_error = search_1d(
            candidates, lambda v, lo=lo: model.sse(np.full_like(v, lo), v)
        )
        if new_error < error:
            hi, error, moved = new_hi, new_error, moved or new_hi != hi
        if not moved:
            break
    return lo, hi


def mse_range(hist: Histogram, scheme: QScheme) -> tuple[float, float]:
    """The range minimising the modelled squared error (module docstring)."""
    model = ErrorModel(hist, scheme)
    threshold, error = search_1d(threshold_grid(hist), lambda t: model.sse(*clipped_range(hist, t)))
    lo, hi = (float(v) for v in clipped_range(hist, threshold))
    if not scheme.symmetric:
        lo, hi = _descend(model, hist, lo, hi, error)
    return lo, hi


@register_observer("mse")
class MSEObserver(HistogramObserver):
    """Range minimising the expected quantize-dequantize MSE for the scheme."""

    _cache: tuple[tuple, tuple[float, float]] | None = None

    def _range(self, scheme: QScheme | None) -> tuple[float, float]:
        scheme = self._require_scheme(scheme)
        hist = self.histogram
        if hist.min == hist.max:
            return hist.min, hist.max
        # the last answer, keyed by the statistics' content: quantize asks twice per tensor
        # (freeze, then dead_ranges), and the search is most of mse's cost
        key = (scheme, hist.half_range, hist.min, hist.max, hist.counts.tobytes())
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, mse_range(hist, scheme))
        return self._cache[1]
