"""``mse_mean_minmax``: the MSE range, never narrower than the mean of the batch extrema.

Two statistics of one stream of batches ``x_t`` (per tensor only, like every histogram method):
the histogram of all values (``_histogram``), from which ``mse`` picks the range
:math:`[lo_{mse}, hi_{mse}]` minimising the modelled quantize-dequantize error (``_mse``), and
the mean over batches of the batch extrema (``mean_minmax``, ``_minmax``),
:math:`\\bar m = \\frac{1}{T}\\sum_t \\min x_t`, :math:`\\bar M = \\frac{1}{T}\\sum_t \\max x_t`.
The range is

.. math:: lo = \\min(lo_{mse}, \\bar m), \\qquad hi = \\max(hi_{mse}, \\bar M)

and always lies inside the running ``[min, max]`` (both terms do).

Why. Both terms estimate a property of the data distribution, not of how much data was seen:
the pooled histogram converges as batches are added, and so does the mean of the batch extrema,
where the running ``minmax`` widens with every batch that holds a rarer outlier (the expected
maximum of ``T`` draws grows with ``T``). MSE alone weighs every value equally, so on a
heavy-tailed tensor it clips the few largest values of every input -- the peaks a following
layer often acts on; the floor keeps what a typical batch reaches and clips only excursions
beyond it.

State: the histogram's (``counts``, ``half_range``, ``min``, ``max``, ``num_bins``) and the
float64 sums of the batch extrema with the batch count (``sum_min``, ``sum_max``,
``batches``). Merge adds both exactly (histograms re-bin exactly to the larger range; sums add),
so streaming equals any merge of parts up to the order of the float64 additions.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from quantbridge.numerics import PerChannel, PerTensor, QScheme

from ._base import Observer, StateDict, StateValue
from ._histogram import DEFAULT_NUM_BINS, HistogramObserver
from ._mse import mse_range
from ._registry import register_observer


@register_observer("mse_mean_minmax")
class MSEMeanMinMaxObserver(HistogramObserver):
    """The ``mse`` range widened to the ``mean_minmax`` range (see the module docstring)."""

    tensor_merge = False  # the float64 extrema sums merge by state dicts, not int64 tensors
    merge_size = Observer.merge_size
    merge_maxima = Observer.merge_maxima
    load_maxima = Observer.load_maxima
    merge_sums = Observer.merge_sums
    load_sums = Observer.load_sums

    def __init__(
        self, granularity: PerTensor | PerChannel | None = None, num_bins: int = DEFAULT_NUM_BINS
    ) -> None:
        super().__init__(granularity, num_bins)
        self.sum_min = 0.0
        self.sum_max = 0.0
        self.batches = 0

    def _update(self, arr: np.ndarray, lo: float, hi: float) -> None:
        super()._update(arr, lo, hi)
        self.sum_min += float(lo)
        self.sum_max += float(hi)
        self.batches += 1

    def _range(self, scheme: QScheme | None) -> tuple[float, float]:
        scheme = self._require_scheme(scheme)
        hist = self.histogram
        mean_lo, mean_hi = self.sum_min / self.batches, self.sum_max / self.batches
        if hist.min == hist.max:
            return hist.min, hist.max
        lo, hi = mse_range(hist, scheme)
        return min(lo, mean_lo), max(hi, mean_hi)

    def _state(self) -> StateDict:
        return {
            **super()._state(),
            "sum_min": float(self.sum_min),
            "sum_max": float(self.sum_max),
            "batches": int(self.batches),
        }

    def _load_state(self, state: Mapping[str, StateValue]) -> None:
        super()._load_state(state)
        self.sum_min, self.sum_max = float(state["sum_min"]), float(state["sum_max"])
        self.batches = int(state["batches"])

    def _merge_state(self, state: Mapping[str, StateValue]) -> None:
        super()._merge_state(state)
        self.sum_min += float(state["sum_min"])
        self.sum_max += float(state["sum_max"])
        self.batches += int(state["batches"])
