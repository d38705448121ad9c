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

Cost. A candidate's error is summed by rounding cells (``_Cells``: exact int64 moments of the
bins inside each cell, the per-bin formula only for bins a cell boundary cuts), O(levels)
instead of O(bins): on 325 histograms of ResNet-18-style and PP-OCRv4 det (8192 bins, int8 /
uint8, ~105 candidates a call) the search takes 28 ms a tensor instead of 65 (one thread; 33
instead of 116 ms wall with numpy's two default threads, which the per-bin matrix product used),
with the identical ranges.
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
        self.density = self.counts / self.widths
        self.scheme = dataclasses.replace(scheme, granularity=PerChannel(0))
        self.cells = _Cells.of(hist, first, last, self.counts, scheme)

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
        if self.cells is not None:
            return self.cells.sse(self, scale, u_lo, u_hi)
        cumulative = cumulative_squared_error(self.edges[None, :], scale, u_lo, u_hi)
        return (np.diff(cumulative, axis=1) / self.widths) @ self.counts


class _Cells:
    """The same sum by rounding cells: O(levels) per candidate instead of O(bins).

    Inside one rounding cell (the values ``round(clip(x / s))`` maps to one code ``r``; the two
    outer cells reach past the grid) ``E(b) - E(a) = ((b - s r)^3 - (a - s r)^3) / 3``, so a bin
    of width ``w`` and midpoint ``m`` wholly inside it contributes ``c ((m - s r)^2 + w^2/12)``:
    a cell's sum needs only the bins' count, first and second moments. Interior bins have
    midpoints ``m = u w / 2`` with odd integers ``u = 2k - N + 1``, so the moments are exact
    int64 prefix sums and ``sum c (u - g)^2`` about the cell centre ``g = 2 s r / w = g0 + d``
    (``g0`` the nearest integer) is ``A - 2 d T + d^2 C`` with ``A = sum c (u - g0)^2`` and
    ``T = sum c (u - g0)`` exact: no cancellation. Bins a cell boundary ``s (r + 1/2)`` cuts, and
    the two outer bins (edges moved to the data's min / max), take the exact per-bin formula.
    Used where the grid has far fewer levels than the histogram has bins (8-bit and below).
    """

    def __init__(self, first: int, half: int, width: float, counts: np.ndarray) -> None:
        self.first, self.half, self.width, self.n = first, half, width, counts.size
        inner = counts.astype(np.int64)  # the outer bins are summed by the exact formula
        inner[0] = inner[-1] = 0
        u = 2 * (first + np.arange(self.n, dtype=np.int64)) - 2 * half + 1
        zero = np.zeros(1, dtype=np.int64)
        self.p0 = np.concatenate([zero, np.cumsum(inner)])
        self.p1 = np.concatenate([zero, np.cumsum(inner * u)])
        self.p2 = np.concatenate([zero, np.cumsum(inner * u * u)])

    @classmethod
    def of(
        cls, hist: Histogram, first: int, last: int, counts: np.ndarray, scheme: QScheme
    ) -> _Cells | None:
        levels = scheme.qmax - scheme.qmin + 1
        # int64 exactness: |u| <= N and |g0| <= 2N (a power-of-two scale at most doubles the
        # grid), so every partial sum is below total (4N)^2; a grid as fine as the bins gains
        # nothing
        total = int(counts.sum())
        if 4 * levels > counts.size or total * (4 * hist.num_bins) ** 2 >= 1 << 62:
            return None
        return cls(first, hist.num_bins // 2, hist.bin_width, counts)

    def sse(self, model: ErrorModel, scale: np.ndarray, u_lo: np.ndarray, u_hi: np.ndarray):
        levels = int(model.scheme.qmax - model.scheme.qmin) + 1
        codes = u_lo + np.arange(levels, dtype=np.float64)  # (M, L): each cell's code r
        # the bin (relative index) holding each boundary s (r + 1/2), clipped to [-1, n]
        bound = scale * (codes[:, :-1] + 0.5)
        cut = np.floor(bound / self.width) + (self.half - self.first)
        cut = np.clip(cut, -1, self.n).astype(np.int64)
        start = np.concatenate([np.zeros_like(cut[:, :1]), np.minimum(cut + 1, self.n)], axis=1)
        stop = np.concatenate([cut, np.full_like(cut[:, :1], self.n)], axis=1)
        stop = np.maximum(stop, start)
        count = self.p0[stop] - self.p0[start]
        s1 = self.p1[stop] - self.p1[start]
        s2 = self.p2[stop] - self.p2[start]
        centre = 2.0 * scale * codes / self.width
        g0 = np.round(centre)
        d = centre - g0
        g0 = g0.astype(np.int64)
        a = s2 - 2 * g0 * s1 + g0 * g0 * count  # exact: sum c (u - g0)^2
        t = s1 - g0 * count  # exact: sum c (u - g0)
        quarter = 0.25 * self.width * self.width
        cells = quarter * (a - 2.0 * d * t + d * d * count) + count * (self.width**2 / 12.0)
        total = cells.sum(axis=1)
        # the cut bins, once each (two boundaries in one bin), and the two outer bins: the
        # per-bin formula on both edges in one evaluation, weight 0 where a cut is not counted
        inside = (cut > 0) & (cut < self.n - 1)
        inside[:, 1:] &= cut[:, 1:] != cut[:, :-1]
        outer = np.zeros_like(cut[:, :1])
        bins = np.concatenate([outer, np.where(inside, cut, 0), outer + (self.n - 1)], axis=1)
        density = model.density
        weight = np.concatenate(
            [
                np.full(outer.shape, density[0]),  # n >= 4 levels: two distinct outer bins
                np.where(inside, density[bins[:, 1:-1]], 0.0),
                np.full(outer.shape, density[-1]),
            ],
            axis=1,
        )
        edges = np.stack([model.edges[bins], model.edges[bins + 1]])
        cumulative = cumulative_squared_error(edges, scale, u_lo, u_hi)
        return total + ((cumulative[1] - cumulative[0]) * weight).sum(axis=1)


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
