"""The observer protocol shared by every range estimator.

An observer watches a stream of batches of one tensor and answers one question: which
clipping range ``[lo, hi]`` should ``numerics.choose_qparams`` turn into a scale and zero point.

Contract (every method, every subclass):

* ``update(x)`` -- ``x`` is a numpy array or a torch tensor (read as
  ``x.detach().cpu().float().numpy()``; float64 tensors stay float64). Batches arrive one at a
  time; an observer keeps bounded statistics (extrema, a fixed-size histogram) and never stores
  activations. Any NaN or +-inf in a batch raises ``ValueError`` naming the counts, and the
  observer is left unchanged (callers prefix the tensor name). Empty batches are ignored.
* ``merge(other)`` -- fold in the statistics of another observer of the same method and
  configuration, or of its ``state_dict()`` (as received from another process).
* ``state_dict()`` / ``load_state_dict(d)`` -- plain ``np.ndarray | float | int | str`` values,
  so an all-gather or a safetensors file can carry them. ``merge`` accepts the dict directly.
* ``range(scheme=None)`` -- ``(lo, hi)`` as float64 arrays, shape ``()`` per tensor and ``(C,)``
  per channel. Methods whose answer depends on the integer grid (``entropy``, ``mse``) require
  the scheme here, not at construction: one set of statistics can then serve several schemes
  (bit-width sweeps), and ``qparams(scheme)`` needs the scheme anyway. Methods that do not
  need it ignore it. ``ValueError("observer saw no data ...")`` before any non-empty update.
* ``qparams(scheme)`` -- ``choose_qparams(*range(scheme), scheme)``.

Exact merging as tensors (observers with ``tensor_merge = True``), for an all-reduce across
processes that never reads an observer's internals. Two rounds, each one elementwise reduction:

1. ``merge_size()`` -- the layout every process holding data must share (channels, histogram
   bins; 0 for "no data, any layout"); ``merge_maxima(size)`` -- float64 values combined by
   elementwise MAX (ranges as ``[-min, max]``); ``load_maxima(maxima, size)`` aligns this
   observer to the combined ranges (a histogram grows to the common range).
2. ``merge_sums()`` -- int64 values combined by elementwise SUM (histogram counts), valid after
   ``load_maxima``; ``load_sums(sums, values_seen)`` installs the totals.

Any other observer merges by ``merge(state_dict)`` of each process's state.

All-zero data gives ``(0, 0)``; ``choose_qparams`` owns the fallback scale for that case.
"""

from __future__ import annotations

import abc
import math
import sys
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from quantbridge.numerics import PerChannel, PerTensor, QScheme, choose_qparams

StateValue = np.ndarray | float | int | str
_TORCH_MIN_SIZE = 1 << 16  # below this, numpy's call overhead is the smaller one
StateDict = dict[str, StateValue]


def as_numpy(x: Any) -> np.ndarray:
    """``x`` as a real numpy array; torch tensors are detached, moved to CPU, read as float32.

    torch is never imported here: a tensor can only exist if the caller already imported it.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        return (t.double() if t.dtype == torch.float64 else t.float()).numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"observers take real numeric arrays or tensors, got dtype {arr.dtype}")
    return arr


def torch_view(arr: np.ndarray) -> Any:
    """A torch tensor sharing ``arr``'s memory, or None where numpy should do the work.

    Large float32/float64 batches go through torch's multi-threaded kernels (one pass where
    numpy needs several) -- only when torch is already loaded, which it is whenever the batch
    came from a tensor. Small or read-only arrays stay with numpy.
    """
    torch = sys.modules.get("torch")
    if (
        torch is None
        or arr.size < _TORCH_MIN_SIZE
        or arr.dtype not in (np.float32, np.float64)
        or not arr.flags.writeable
    ):
        return None
    return torch.from_numpy(arr)


def extrema(arr: np.ndarray) -> tuple[float, float]:
    """``(min, max)`` of a non-empty array as floats; NaN if the array holds a NaN."""
    t = torch_view(arr)
    if t is None:
        return float(arr.min()), float(arr.max())
    lo, hi = sys.modules["torch"].aminmax(t)
    return float(lo), float(hi)


def describe_nonfinite(arr: np.ndarray) -> str:
    """The message for a batch holding NaN or inf: counts of each kind and the batch shape."""
    nan = int(np.count_nonzero(np.isnan(arr)))
    pos_inf = int(np.count_nonzero(arr == np.inf))
    neg_inf = int(np.count_nonzero(arr == -np.inf))
    return (
        f"observer got non-finite values: {nan} NaN, {pos_inf} +inf, {neg_inf} -inf "
        f"among {arr.size} values of a batch of shape {arr.shape}; a quantization range "
        "cannot be computed from them"
    )


def granularity_key(granularity: PerTensor | PerChannel) -> str:
    return "per_channel" if isinstance(granularity, PerChannel) else "per_tensor"


class Observer(abc.ABC):
    """Base class: input conversion, the NaN/inf check, state-dict headers, and ``qparams``.

    Subclasses implement ``_update``, ``_range``, ``_state``, ``_load_state`` and
    ``_merge_state`` on already-validated inputs. ``method`` is set by ``register_observer``.
    """

    method: ClassVar[str] = ""
    # Whether the merge_* / load_* tensor protocol is implemented (see the module docstring),
    # and what merge_size() counts (for the error when processes disagree).
    tensor_merge: ClassVar[bool] = False
    merge_size_name: ClassVar[str] = "sizes"
    # Option names that must agree between two observers' states for them to merge.
    _state_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, granularity: PerTensor | PerChannel | None = None) -> None:
        granularity = PerTensor() if granularity is None else granularity
        if not isinstance(granularity, (PerTensor, PerChannel)):
            raise TypeError(
                f"granularity must be PerTensor() or PerChannel(axis), got {granularity!r}"
            )
        self.granularity = granularity
        self.values_seen = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(granularity={self.granularity!r}, seen={self.values_seen})"

    # ---- public protocol -------------------------------------------------------------------

    def update(self, x: Any) -> None:
        """Fold one batch into the statistics (see the module docstring for the contract)."""
        arr = as_numpy(x)
        self._check_batch(arr)
        if arr.size == 0:
            return
        lo, hi = extrema(arr)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError(describe_nonfinite(arr))
        self._update(arr, lo, hi)
        self.values_seen += int(arr.size)

    def merge(self, other: Observer | Mapping[str, StateValue]) -> None:
        """Add another observer's statistics (an observer or its ``state_dict()``)."""
        if isinstance(other, Observer):
            if type(other) is not type(self):
                raise ValueError(
                    f"cannot merge a {type(other).__name__} into a {type(self).__name__}"
                )
            other = other.state_dict()
        state = self._checked_state(other)
        if state["values_seen"] == 0:
            return
        if self.values_seen == 0:
            self.load_state_dict(state)
            return
        self._merge_state(state)
        self.values_seen += int(state["values_seen"])

    def state_dict(self) -> StateDict:
        """Plain arrays and scalars; ``load_state_dict(state_dict())`` restores the observer."""
        header: StateDict = {
            "method": self.method,
            "granularity": granularity_key(self.granularity),
            "values_seen": int(self.values_seen),
        }
        if isinstance(self.granularity, PerChannel):
            header["axis"] = int(self.granularity.axis)
        return {**header, **self._state()}

    def load_state_dict(self, state: Mapping[str, StateValue]) -> None:
        """Replace the statistics by those in ``state`` (validated against this observer)."""
        state = self._checked_state(state)
        self._load_state(state)
        self.values_seen = int(state["values_seen"])

    def range(self, scheme: QScheme | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The clipping range ``(lo, hi)``, float64, shape ``()`` or ``(C,)``."""
        if self.values_seen == 0:
            raise ValueError(
                f"observer saw no data: the {self.method!r} observer needs at least one "
                "non-empty update() before range() or qparams()"
            )
        if scheme is not None and not isinstance(scheme, QScheme):
            raise TypeError(f"scheme must be a QScheme, got {scheme!r}")
        lo, hi = self._range(scheme)
        return np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)

    def qparams(self, scheme: QScheme) -> tuple[np.ndarray, np.ndarray]:
        """``choose_qparams(*self.range(scheme), scheme)``: float32 scale, int32 zero point."""
        if not isinstance(scheme, QScheme):
            raise TypeError(f"scheme must be a QScheme, got {scheme!r}")
        if granularity_key(scheme.granularity) != granularity_key(self.granularity):
            raise ValueError(
                f"scheme granularity {scheme.granularity!r} does not match the observer's "
                f"{self.granularity!r}; build the observer with the scheme's granularity"
            )
        return choose_qparams(*self.range(scheme), scheme)

    # ---- exact merge as tensors (tensor_merge = True; see the module docstring) ------------

    def merge_size(self) -> int:
        """The layout processes must agree on (0: no data, any layout)."""
        raise NotImplementedError(f"the {self.method!r} observer merges by state dicts only")

    def merge_maxima(self, size: int) -> np.ndarray:
        """float64 values to combine by elementwise MAX (``size``: the agreed layout)."""
        raise NotImplementedError(f"the {self.method!r} observer merges by state dicts only")

    def load_maxima(self, maxima: np.ndarray, size: int) -> None:
        """Take the combined maxima (the observer then holds the common layout)."""
        raise NotImplementedError(f"the {self.method!r} observer merges by state dicts only")

    def merge_sums(self) -> np.ndarray:
        """int64 values to combine by elementwise SUM (after ``load_maxima``)."""
        raise NotImplementedError(f"the {self.method!r} observer merges by state dicts only")

    def load_sums(self, sums: np.ndarray, values_seen: int) -> None:
        """Take the combined sums and the total number of values seen."""
        raise NotImplementedError(f"the {self.method!r} observer merges by state dicts only")

    # ---- hooks for subclasses --------------------------------------------------------------

    def _check_batch(self, arr: np.ndarray) -> None:  # noqa: B027 -- optional hook
        """Reject a batch of the wrong layout before anything is computed (default: accept)."""

    @abc.abstractmethod
    def _update(self, arr: np.ndarray, lo: float, hi: float) -> None:
        """Fold a finite, non-empty batch whose global extrema are ``lo``, ``hi``."""

    @abc.abstractmethod
    def _range(self, scheme: QScheme | None) -> tuple[Any, Any]: ...

    @abc.abstractmethod
    def _state(self) -> StateDict:
        """The subclass's part of ``state_dict()``."""

    @abc.abstractmethod
    def _load_state(self, state: Mapping[str, StateValue]) -> None: ...

    @abc.abstractmethod
    def _merge_state(self, state: Mapping[str, StateValue]) -> None:
        """Merge a validated, non-empty state into this non-empty observer."""

    # ---- validation ------------------------------------------------------------------------

    def _checked_state(self, state: Mapping[str, StateValue]) -> dict[str, StateValue]:
        if not isinstance(state, Mapping):
            raise TypeError(f"expected an observer or a state dict, got {type(state).__name__}")
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        unknown = sorted(set(state) - set(expected))
        if missing or unknown:
            raise ValueError(
                f"state dict does not fit a {self.method!r} observer with "
                f"{self.granularity!r}: missing keys {missing}, unexpected keys {unknown}"
            )
        for key in ("method", "granularity", "axis", *self._state_keys):
            if key in expected and _plain(state[key]) != expected[key]:
                raise ValueError(
                    f"state dict has {key}={_plain(state[key])!r} but this observer has "
                    f"{key}={expected[key]!r}; only observers of the same configuration merge"
                )
        return dict(state)


def _plain(value: StateValue) -> Any:
    """A 0-d array (as a state dict from safetensors may hold) read as a Python scalar."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    return value
