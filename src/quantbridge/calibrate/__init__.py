"""Calibration: observers (range estimators) that turn a stream of batches into a range.

Every observer follows one protocol (``Observer``, see ``_base``): ``update(x)`` streams
batches with bounded memory, ``merge`` / ``state_dict`` / ``load_state_dict`` combine
statistics across processes, ``range(scheme)`` gives the clipping range ``(lo, hi)`` and
``qparams(scheme)`` the scale and zero point from ``numerics.choose_qparams``.

Methods, by registry name (``make_observer(method, granularity, **options)``):

=========================  ===========================================  ===================
method                     range                                        granularity
=========================  ===========================================  ===================
``minmax``                 running min / max (exact merge)              tensor, channel
``moving_average_minmax``  EMA of batch min / max, constant 0.01        tensor, channel
``mean_minmax``            mean of batch min / max (NNCF default)       tensor, channel
``percentile``             ``[P_{100-p}, P_p]`` from the histogram      tensor
``entropy``                min KL divergence (TensorRT), needs scheme   tensor
``mse``                    min expected quantization MSE, needs scheme  tensor
=========================  ===========================================  ===================
"""

from ._base import Observer, as_numpy
from ._entropy import EntropyObserver, kl_divergences
from ._histogram import DEFAULT_NUM_BINS, Histogram, HistogramObserver
from ._minmax import MeanMinMaxObserver, MinMaxObserver, MovingAverageMinMaxObserver
from ._mse import MSEObserver, cumulative_squared_error
from ._percentile import PercentileObserver, histogram_percentile
from ._registry import make_observer, observer_class, register_observer, registered_methods

__all__ = [
    "DEFAULT_NUM_BINS",
    "EntropyObserver",
    "Histogram",
    "HistogramObserver",
    "MSEObserver",
    "MeanMinMaxObserver",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "Observer",
    "PercentileObserver",
    "as_numpy",
    "cumulative_squared_error",
    "histogram_percentile",
    "kl_divergences",
    "make_observer",
    "observer_class",
    "register_observer",
    "registered_methods",
]
