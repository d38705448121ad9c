"""Extrema observers: running min/max and its exponential moving average (per tensor or channel).

Per batch ``x_t`` the observer computes the batch extrema, over the whole tensor or, for
``PerChannel(axis)``, over every axis but ``axis`` (``C = x.shape[axis]`` values each):

.. math:: m_t = \\min x_t, \\qquad M_t = \\max x_t

``minmax`` keeps :math:`lo = \\min_t m_t`, :math:`hi = \\max_t M_t`: streaming equals one pass
over the concatenation, and merging is exact and order-independent (elementwise min / max).

``moving_average_minmax`` follows torch.ao's ``MovingAverageMinMaxObserver`` with averaging
constant :math:`c` (0.01): the first batch initialises :math:`lo_1 = m_1`; then

.. math:: lo_t = lo_{t-1} + c\\,(m_t - lo_{t-1}), \\qquad hi_t = hi_{t-1} + c\\,(M_t - hi_{t-1})

The EMA depends on batch order, so no merge can reproduce one stream over all batches. Merge is
the average weighted by the number of batches each side saw,
:math:`lo = (n_a lo_a + n_b lo_b) / (n_a + n_b)` -- an approximation, documented as such.

``mean_minmax`` is NNCF's default for per-tensor activations (``RangeEstimatorParametersSet.
MEAN_MINMAX``: statistic MIN / MAX, aggregator MEAN; nncf/quantization/algorithms/min_max/
algorithm.py ``_get_range_estimator_parameters``): the mean over batches of the batch extrema,

.. math:: lo = \\frac{1}{T} \\sum_t m_t, \\qquad hi = \\frac{1}{T} \\sum_t M_t

Per batch, not per sample: NNCF reduces per sample only with ``batchwise_statistics``, which it
switches on only when its dataset reports a batch size > 1 (a torch ``DataLoader``;
nncf/quantization/quantize_model.py ``_update_advanced_quantization_parameters``), never for a
list of feeds, which is how the bench (and ONNX users) give it data. Unlike ``minmax``, the range
does not grow with the amount of data (one outlier batch moves it by :math:`1/T` of its excess);
it depends on the batch size (smaller batches: narrower range). The state is the float64 sums and
the batch count :math:`T`, so merge is the exact count-weighted average (sums add; equal to one
stream up to the order of the float64 additions). ``update_extrema`` counts one batch per call.

All check that every batch of a per-channel observer has the channel count of the first.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping

import numpy as np

from quantbridge.numerics import PerChannel, PerTensor, QScheme

from ._base import Observer, StateDict, StateValue
from ._registry import register_observer


class _ExtremaObserver(Observer):
    """Shared part: per-batch extrema at the observer's granularity, channel-count checks."""

    def __init__(self, granularity: PerTensor | PerChannel | None = None) -> None:
        super().__init__(granularity)
        self._lo: np.ndarray | None = None
        self._hi: np.ndarray | None = None

    def _batch_extrema(self, arr: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, ...]:
        if not isinstance(self.granularity, PerChannel):
            return np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
        axis = self.granularity.resolve_axis(arr.ndim)
        others = tuple(i for i in range(arr.ndim) if i != axis)
        return (
            arr.min(axis=others).astype(np.float64),
            arr.max(axis=others).astype(np.float64),
        )

    def _check_batch(self, arr: np.ndarray) -> None:
        if not isinstance(self.granularity, PerChannel):
            return
        axis = self.granularity.resolve_axis(arr.ndim)
        if self._lo is not None and arr.shape[axis] != self._lo.shape[0]:
            raise ValueError(
                f"per-channel observer along axis {self.granularity.axis} holds statistics of "
                f"shape {self._lo.shape} ({self._lo.shape[0]} channels) but got a batch of "
                f"shape {arr.shape} ({arr.shape[axis]} channels)"
            )

    def _empty(self) -> np.ndarray:
        shape = (0,) if isinstance(self.granularity, PerChannel) else ()
        return np.full(shape, np.nan)

    def _read_state(
        self, state: Mapping[str, StateValue], merging: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        lo = np.array(state["min"], dtype=np.float64)
        hi = np.array(state["max"], dtype=np.float64)
        want_ndim = 1 if isinstance(self.granularity, PerChannel) else 0
        if lo.shape != hi.shape or lo.ndim != want_ndim:
            raise ValueError(
                f"state dict min/max have shapes {lo.shape} and {hi.shape}; expected equal "
                f"shapes of rank {want_ndim} for {self.granularity!r}"
            )
        if merging and lo.shape != self._lo.shape:
            raise ValueError(
                f"cannot merge per-channel statistics of shape {lo.shape} into an observer "
                f"holding shape {self._lo.shape}"
            )
        return lo, hi

    def _range(self, scheme: QScheme | None) -> tuple[np.ndarray, np.ndarray]:
        assert self._lo is not None and self._hi is not None
        return self._lo.copy(), self._hi.copy()

    def _update(self, arr: np.ndarray, lo: float, hi: float) -> None:
        self._fold(*self._batch_extrema(arr, lo, hi))

    def update_extrema(self, lo, hi, count: int) -> None:
        """Fold one batch of ``count`` values given by its extrema (float64, shape ``()`` per
        tensor, ``(C,)`` per channel), e.g. extrema already reduced over several processes."""
        lo = np.array(lo, dtype=np.float64)
        hi = np.array(hi, dtype=np.float64)
        want_ndim = 1 if isinstance(self.granularity, PerChannel) else 0
        if lo.shape != hi.shape or lo.ndim != want_ndim:
            raise ValueError(
                f"batch extrema have shapes {lo.shape} and {hi.shape}; expected equal shapes of "
                f"rank {want_ndim} for {self.granularity!r}"
            )
        if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
            raise ValueError(f"observer got non-finite batch extrema {lo} and {hi}")
        if count <= 0:
            return
        if want_ndim and self._lo is not None and lo.shape != self._lo.shape:
            raise ValueError(
                f"per-channel observer holds {self._lo.shape[0]} channels, got extrema of "
                f"{lo.shape[0]}"
            )
        self._fold(lo, hi)
        self.values_seen += int(count)

    @abc.abstractmethod
    def _fold(self, batch_lo: np.ndarray, batch_hi: np.ndarray) -> None:
        """Fold one batch's extrema into the statistics."""


@register_observer("minmax")
class MinMaxObserver(_ExtremaObserver):
    """Running minimum and maximum, per tensor or per channel along any axis."""

    tensor_merge = True
    merge_size_name = "channel counts"

    def merge_size(self) -> int:
        """Values per extremum (1 per tensor, ``C`` per channel); 0 before any data."""
        return int(self._lo.size) if self._lo is not None else 0

    def merge_maxima(self, size: int) -> np.ndarray:
        """``[-min, max]`` flattened (``-inf`` for an observer without data)."""
        if self._lo is None:
            return np.full(2 * size, -np.inf)
        return np.concatenate([-self._lo.reshape(-1), self._hi.reshape(-1)]).astype(np.float64)

    def load_maxima(self, maxima: np.ndarray, size: int) -> None:
        shape = (size,) if isinstance(self.granularity, PerChannel) else ()
        maxima = np.asarray(maxima, dtype=np.float64)
        self._lo, self._hi = (-maxima[:size]).reshape(shape), maxima[size : 2 * size].reshape(shape)

    def merge_sums(self) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)

    def load_sums(self, sums: np.ndarray, values_seen: int) -> None:
        self.values_seen = int(values_seen)

    def _fold(self, batch_lo: np.ndarray, batch_hi: np.ndarray) -> None:
        if self._lo is None:
            self._lo, self._hi = batch_lo, batch_hi
        else:
            self._lo = np.minimum(self._lo, batch_lo)
            self._hi = np.maximum(self._hi, batch_hi)

    def _state(self) -> StateDict:
        if self._lo is None:
            return {"min": self._empty(), "max": self._empty()}
        return {"min": self._lo.copy(), "max": self._hi.copy()}

    def _load_state(self, state: Mapping[str, StateValue]) -> None:
        lo, hi = self._read_state(state, merging=False)
        seen = int(state["values_seen"]) > 0
        self._lo, self._hi = (lo, hi) if seen else (None, None)

    def _merge_state(self, state: Mapping[str, StateValue]) -> None:
        lo, hi = self._read_state(state, merging=True)
        self._lo = np.minimum(self._lo, lo)
        self._hi = np.maximum(self._hi, hi)


@register_observer("moving_average_minmax")
class MovingAverageMinMaxObserver(_ExtremaObserver):
    """Exponential moving average of batch extrema (torch.ao's, ``averaging_constant=0.01``)."""

    def __init__(
        self,
        granularity: PerTensor | PerChannel | None = None,
        averaging_constant: float = 0.01,
    ) -> None:
        super().__init__(granularity)
        if not 0.0 < averaging_constant <= 1.0:
            raise ValueError(f"averaging_constant must be in (0, 1], got {averaging_constant}")
        self.averaging_constant = float(averaging_constant)
        self.batches = 0

    def _fold(self, batch_lo: np.ndarray, batch_hi: np.ndarray) -> None:
        if self._lo is None:
            self._lo, self._hi = batch_lo, batch_hi
        else:
            c = self.averaging_constant
            self._lo = self._lo + c * (batch_lo - self._lo)
            self._hi = self._hi + c * (batch_hi - self._hi)
        self.batches += 1

    def _state(self) -> StateDict:
        if self._lo is None:
            return {"min": self._empty(), "max": self._empty(), "batches": 0}
        return {"min": self._lo.copy(), "max": self._hi.copy(), "batches": int(self.batches)}

    def _load_state(self, state: Mapping[str, StateValue]) -> None:
        lo, hi = self._read_state(state, merging=False)
        seen = int(state["values_seen"]) > 0
        self._lo, self._hi = (lo, hi) if seen else (None, None)
        self.batches = int(state["batches"]) if seen else 0

    def _merge_state(self, state: Mapping[str, StateValue]) -> None:
        """Batch-weighted average of the two EMAs (an approximation, see the module docstring)."""
        lo, hi = self._read_state(state, merging=True)
        n_self, n_other = self.batches, int(state["batches"])
        total = n_self + n_other
        self._lo = (n_self * self._lo + n_other * lo) / total
        self._hi = (n_self * self._hi + n_other * hi) / total
        self.batches = total


@register_observer("mean_minmax")
class MeanMinMaxObserver(_ExtremaObserver):
    """Mean over batches of the batch extrema: NNCF's ``MEAN_MINMAX`` (see the module docstring)."""

    def __init__(self, granularity: PerTensor | PerChannel | None = None) -> None:
        super().__init__(granularity)
        self.batches = 0

    def _fold(self, batch_lo: np.ndarray, batch_hi: np.ndarray) -> None:
        # the sums of the batch extrema; range() divides by the batch count
        if self._lo is None:
            self._lo, self._hi = np.array(batch_lo), np.array(batch_hi)
        else:
            self._lo = self._lo + batch_lo
            self._hi = self._hi + batch_hi
        self.batches += 1

    def _range(self, scheme: QScheme | None) -> tuple[np.ndarray, np.ndarray]:
        assert self._lo is not None and self._hi is not None
        return self._lo / self.batches, self._hi / self.batches

    def _state(self) -> StateDict:
        if self._lo is None:
            return {"min": self._empty(), "max": self._empty(), "batches": 0}
        lo, hi = self._range(None)
        return {"min": lo, "max": hi, "batches": int(self.batches)}

    def _load_state(self, state: Mapping[str, StateValue]) -> None:
        lo, hi = self._read_state(state, merging=False)
        n = int(state["batches"]) if int(state["values_seen"]) > 0 else 0
        self._lo, self._hi = (lo * n, hi * n) if n else (None, None)
        self.batches = n

    def _merge_state(self, state: Mapping[str, StateValue]) -> None:
        """Count-weighted average: the other side's mean times its batch count adds to ours."""
        lo, hi = self._read_state(state, merging=True)
        n = int(state["batches"])
        self._lo = self._lo + lo * n
        self._hi = self._hi + hi * n
        self.batches += n
