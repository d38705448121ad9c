"""Percentile calibration: clip each tail at a percentile read from the histogram.

For ``percentile = p`` (default 99.99) the range is

.. math:: lo = P_{100 - p}(x), \\qquad hi = P_{p}(x)

so each tail loses at most ``(100 - p)`` percent of the values. The scheme is not used (a
symmetric scheme then takes ``max(-lo, hi)`` in ``choose_qparams``).

``P_q`` follows numpy's default ("linear") definition on the sorted values
:math:`x_{(0)} \\le \\dots \\le x_{(n-1)}`: with :math:`r = q/100 \\cdot (n-1)`,
:math:`k = \\lfloor r \\rfloor`, :math:`g = r - k`,
:math:`P_q = (1-g)\\, x_{(k)} + g\\, x_{(k+1)}`. The histogram does not hold the sorted values,
so each order statistic is estimated inside its bin, assuming the ``c`` values of the bin
are spread uniformly: the ``i``-th (0-based) sits at ``left + (i + 1/2) / c \\cdot w``, clipped to
the exact ``[min, max]``; :math:`x_{(0)}` and :math:`x_{(n-1)}` are the exact min and max.

Accuracy: the estimate and the true :math:`x_{(k)}` lie in the same bin, so each is off by less
than one bin width ``w``, and so is their convex combination: ``|P_q - np.percentile| < w``.
"""

from __future__ import annotations

import math

import numpy as np

from quantbridge.numerics import PerChannel, PerTensor, QScheme

from ._histogram import DEFAULT_NUM_BINS, Histogram, HistogramObserver
from ._registry import register_observer


def order_statistic(hist: Histogram, k: int) -> float:
    """Estimate of the ``k``-th smallest value (0-based) seen by ``hist``; exact at the ends."""
    n = hist.total
    if k <= 0:
        return hist.min
    if k >= n - 1:
        return hist.max
    cumulative = np.cumsum(hist.counts)
    b = int(np.searchsorted(cumulative, k, side="right"))
    count = int(hist.counts[b])
    rank_in_bin = k - (int(cumulative[b]) - count)
    left = -hist.half_range + b * hist.bin_width
    value = left + (rank_in_bin + 0.5) / count * hist.bin_width
    return min(max(value, hist.min), hist.max)


def histogram_percentile(hist: Histogram, q: float) -> float:
    """``np.percentile(data, q)`` (linear method) estimated from ``hist``, within one bin."""
    n = hist.total
    rank = q / 100.0 * (n - 1)
    k = math.floor(rank)
    g = rank - k
    below = order_statistic(hist, k)
    if g == 0.0:
        return below
    above = order_statistic(hist, k + 1)
    # a + g (b - a), kept inside [a, b]: (1 - g) a + g b rounds below a when a == b (3 -> 2.9999..)
    return min(max(below + g * (above - below), below), above)


@register_observer("percentile")
class PercentileObserver(HistogramObserver):
    """Range ``[P_{100-p}, P_p]`` from a histogram (each tail clipped at ``100 - p`` percent)."""

    def __init__(
        self,
        granularity: PerTensor | PerChannel | None = None,
        percentile: float = 99.99,
        num_bins: int = DEFAULT_NUM_BINS,
    ) -> None:
        super().__init__(granularity, num_bins)
        if not 50.0 <= percentile <= 100.0:
            raise ValueError(
                f"percentile must be in [50, 100] (the upper percentile; the lower one is "
                f"100 - percentile), got {percentile}"
            )
        self.percentile = float(percentile)

    def _range(self, scheme: QScheme | None) -> tuple[float, float]:
        lo = histogram_percentile(self.histogram, 100.0 - self.percentile)
        hi = histogram_percentile(self.histogram, self.percentile)
        return lo, hi
