"""The quantizer module and its life cycle (``QState``).

A ``Quantizer`` is one quantization point in a captured graph (an activation, a weight). It is
in exactly one ``QState`` at a time and moves between states only through methods that check the
move (``_MOVES``):

* ``CALIBRATING`` (placed): the tensor passes through unchanged while an observer from
  ``quantbridge.calibrate`` accumulates its range (float calibration, as ONNX Runtime and PyTorch
  do). Weight quantizers instead derive their parameters from the weight itself on every call.
* ``FROZEN`` (``freeze()``, ``set_qparams``): ``fake_quantize`` with fixed ``scale`` /
  ``zero_point`` buffers, gradients by the clipped straight-through estimator (``_ste``).
* ``TRACKING`` (``track()``, QAT): fake-quantize, and in training mode follow the batch range by a
  moving average (``calibrate.MovingAverageMinMaxObserver``; under DDP the batch range of every
  rank, ``_collective.ddp_batch_range``).
* ``LEARNED`` (``make_learnable()``, QAT with LSQ): the scale (and an asymmetric zero point) are
  Parameters.

``enabled`` is not a state but a bypass orthogonal to it (``float_mode``,
``QuantModel.set_quantization``): a disabled quantizer is the identity and keeps its state.
Export is a context (``_export_ops.export_mode``), not a state: inside it the quantizers hold the
precomputed export tensors (``export_scale`` ...) and emit the custom ops the ONNX exporter
translates into QuantizeLinear / DequantizeLinear.

The state is data: ``state_dict()`` carries it in the ``state`` buffer (``QState.code``), so a
plain ``load_state_dict`` restores it (a state dict from before the ``state`` buffer has a
``calibrated`` flag instead, read as calibrating / frozen); ``qb.save`` writes the moving-average
statistics of a tracking quantizer as well (``tracker_state``).

The kinds of quantizer (weight, constant, int32 bias) are in ``_fakequant``.
"""

from __future__ import annotations

import enum

import numpy as np
import torch
from torch import nn

from ..calibrate import MovingAverageMinMaxObserver, make_observer
from ..numerics import (
    PerChannel,
    PerTensor,
    QScheme,
    choose_qparams,
    quantize,
)
from ..recipe import TensorRecipe
from ._collective import ddp_batch_range
from ._ste import FakeQuantizeSTE, LearnedStepSTE

__all__ = ["QState", "Quantizer"]


class QState(enum.Enum):
    """The life-cycle state of a ``Quantizer`` (see the module docstring)."""

    CALIBRATING = "calibrating"
    FROZEN = "frozen"
    TRACKING = "tracking"
    LEARNED = "learned"

    @property
    def code(self) -> int:
        """The state's number in the ``state`` buffer (0 and 1 are the old ``calibrated`` flag)."""
        return _CODES[self]

    @classmethod
    def from_code(cls, code: int) -> QState:
        for state, c in _CODES.items():
            if c == code:
                return state
        raise ValueError(f"unknown quantizer state code {code}; known: {sorted(_CODES.values())}")


_CODES = {QState.CALIBRATING: 0, QState.FROZEN: 1, QState.TRACKING: 2, QState.LEARNED: 3}

# state -> the states a quantizer in it may move to (a learned scale is a Parameter: no way back
# but ``fix_learned``, which turns it into a buffer again)
_MOVES: dict[QState, frozenset[QState]] = {
    QState.CALIBRATING: frozenset({QState.CALIBRATING, QState.FROZEN}),
    QState.FROZEN: frozenset(QState),
    QState.TRACKING: frozenset(QState),
    QState.LEARNED: frozenset({QState.LEARNED}),
}

TRACKING_AVERAGING_CONSTANT = 0.01  # torch.ao's MovingAverageMinMaxObserver default


class Quantizer(nn.Module):
    """One quantization point: observe, then fake-quantize (see the module docstring)."""

    def __init__(self, name: str, recipe: TensorRecipe, kind: str, axis: int | None = None):
        super().__init__()
        self.name = name  # user-facing: '<module path>:<tensor>'
        self.kind = kind  # 'activation', 'weight' or 'constant'
        self.scheme: QScheme = recipe.scheme
        self.recipe = recipe
        self.axis = axis if isinstance(recipe.scheme.granularity, PerChannel) else None
        self.enabled = True
        self.observer = None  # calibration statistics (CALIBRATING)
        self.tracker: MovingAverageMinMaxObserver | None = None  # moving average (TRACKING)
        # (lo, hi): calibration observes the value clamped to what its readers tell apart
        # (``_reader_ranges``; None: the whole value)
        self.observe_bounds: tuple[float, float] | None = None
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("zero_point", torch.zeros((), dtype=torch.int32))
        # the persisted twin of ``_state`` (a Python value, so that forward never branches on data)
        self.register_buffer("state", torch.zeros((), dtype=torch.uint8))
        self._state = QState.CALIBRATING

    # -- the state ------------------------------------------------------------------------------
    @property
    def qstate(self) -> QState:
        return self._state

    def _move(self, to: QState) -> None:
        self._check_move(to)
        self._set_state(to)

    def _check_move(self, to: QState) -> None:
        if to not in _MOVES[self._state]:
            allowed = sorted(s.value for s in _MOVES[self._state])
            raise ValueError(
                f"{self.kind} quantizer {self.name!r} is {self._state.value} and cannot become "
                f"{to.value} (from {self._state.value}: {allowed})"
            )

    def _set_state(self, to: QState) -> None:
        self._state = to
        self.state.fill_(to.code)
        if to is not QState.TRACKING:
            self.tracker = None

    def restore_state(self, state: QState, tracker: dict | None = None) -> None:
        """Put the quantizer in ``state`` as a saved model had it, before its tensors are loaded
        (a learned quantizer gets its Parameters); ``tracker`` is a saved moving average."""
        if state is QState.LEARNED and self._state is not QState.LEARNED:
            self._become_learned()
        self._set_state(state)
        if state is QState.TRACKING and tracker is not None:
            self.tracker = self._new_tracker()
            self.tracker.load_state_dict(tracker)

    def tracker_state(self) -> dict | None:
        """The moving-average statistics of a tracking quantizer as JSON-able data (or None)."""
        if self.tracker is None:
            return None
        return {
            k: v.tolist() if isinstance(v, np.ndarray) else v
            for k, v in self.tracker.state_dict().items()
        }

    # compatibility views of the state (the flags it replaced); setting ``observing`` is a
    # checked move (True: back to calibrating, False: frozen)
    @property
    def observing(self) -> bool:
        return self._state is QState.CALIBRATING

    @observing.setter
    def observing(self, value: bool) -> None:
        self._move(QState.CALIBRATING if value else QState.FROZEN)

    @property
    def tracking(self) -> bool:
        return self._state is QState.TRACKING

    @property
    def learnable(self) -> bool:
        return self._state is QState.LEARNED

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Accept per-channel shapes from a checkpoint, and restore the saved state (a learned
        quantizer's Parameters first; an old ``calibrated`` flag reads as the state code)."""
        legacy = state_dict.pop(prefix + "calibrated", None)
        if legacy is not None and prefix + "state" not in state_dict:
            code = int(legacy)
            if code and prefix + "log_scale" in state_dict:
                code = QState.LEARNED.code
            state_dict[prefix + "state"] = torch.tensor(code, dtype=torch.uint8)
        incoming_state = state_dict.get(prefix + "state")
        target = QState.from_code(int(incoming_state)) if incoming_state is not None else None
        if target is QState.LEARNED and self._state is not QState.LEARNED:
            self._become_learned()
        for name in ("scale", "zero_point", "log_scale"):
            incoming = state_dict.get(prefix + name)
            if incoming is None or not hasattr(self, name):
                continue
            current = getattr(self, name)
            if incoming.shape != current.shape:
                fresh = torch.empty_like(incoming, dtype=current.dtype)
                if isinstance(current, nn.Parameter):
                    current.data = fresh
                else:
                    setattr(self, name, fresh)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if target is not None and target is not self._state:
            self._set_state(target)
        self.__dict__.pop("_cache", None)

    # -- QAT ------------------------------------------------------------------------------------
    def track(self) -> None:
        """QAT: keep fake-quantizing and let the parameters follow the batch range (moving
        average, constant 0.01) in training mode."""
        self._move(QState.TRACKING)
        if self.tracker is None:
            self.tracker = self._new_tracker()

    def stop_tracking(self) -> None:
        """Keep the moving average's current parameters fixed (TRACKING -> FROZEN)."""
        if self._state is QState.TRACKING:
            self._move(QState.FROZEN)

    def _new_tracker(self) -> MovingAverageMinMaxObserver:
        return MovingAverageMinMaxObserver(PerTensor(), TRACKING_AVERAGING_CONSTANT)

    def make_learnable(self) -> None:
        """LSQ: learn the step size, as ``log_scale`` (a Parameter; ``scale = exp(log_scale)``
        stays positive and Adam's per-step change is relative, as in TQT, Jain et al. 2020),
        and an asymmetric scheme's zero point as a float offset. Initialised from the current
        values; the ``scale`` buffer keeps the value in use for export and the int32 bias."""
        if self._state is QState.LEARNED:
            return
        if self._state is QState.CALIBRATING:
            raise ValueError(
                f"{self.kind} quantizer {self.name!r} is still calibrating: freeze it (or compute "
                "it from its weight) before make_learnable, so LSQ starts from a calibrated scale"
            )
        self._become_learned()
        self._move(QState.LEARNED)

    def _become_learned(self) -> None:
        self.log_scale = nn.Parameter(torch.log(self.scale.detach().clone()))
        if not self.scheme.symmetric:
            zero_point = self.zero_point.detach().float()
            del self.zero_point
            self.zero_point = nn.Parameter(zero_point)

    def fix_learned(self) -> None:
        """End of learning (LEARNED -> FROZEN): the learned scale and the zero point (rounded to
        the grid) become fixed buffers again, the Parameters go (PTQ's output distillation)."""
        if self._state is not QState.LEARNED:
            return
        scale, zero_point = self.current_scale().clone(), self.integer_zero_point()
        del self.log_scale
        if isinstance(self.zero_point, nn.Parameter):
            del self.zero_point
            self.register_buffer("zero_point", zero_point)
        self._set_state(QState.FROZEN)
        self._write_qparams(scale, zero_point)

    def learned_scale(self) -> torch.Tensor:
        """``exp(log_scale)``, differentiable; also refreshes the ``scale`` buffer."""
        scale = self.log_scale.exp()
        self.scale = scale.detach()
        return scale

    def current_scale(self) -> torch.Tensor:
        """The scale in use, detached (what export and the int32 bias see)."""
        return self.log_scale.detach().exp() if self.learnable else self.scale.detach()

    def integer_zero_point(self) -> torch.Tensor:
        """The zero point as int32 (a learned float offset rounded and clipped to the grid)."""
        zp = self.zero_point.detach()
        if zp.is_floating_point():
            zp = zp.round().clamp(self.qmin, self.qmax)
        return zp.to(torch.int32)

    def _track(self, x: torch.Tensor) -> None:
        """Fold the batch range (over every DDP rank) into the moving average; new parameters."""
        with torch.no_grad():
            lo, hi = x.detach().min().double(), x.detach().max().double()
            lo, hi = ddp_batch_range(lo, hi)  # inside DDP: min / max over every rank's batch
            if self.tracker is None:
                self.tracker = self._new_tracker()
            try:
                self.tracker.update_extrema(lo.cpu().numpy(), hi.cpu().numpy(), x.numel())
            except ValueError as e:
                raise ValueError(f"{self.kind} {self.name!r}: {e}") from None
            self._write_qparams(*choose_qparams(*self.tracker.range(), self.scheme))

    @property
    def qmin(self) -> int:
        return self.scheme.qmin

    @property
    def qmax(self) -> int:
        return self.scheme.qmax

    def extra_repr(self) -> str:
        s = self.scheme
        sign = "int" if s.signed else "uint"
        gran = f"per-channel(axis={self.axis})" if self.axis is not None else "per-tensor"
        return f"{self.name!r}, {sign}{s.bits} [{s.qmin}, {s.qmax}], {gran}, {self._state.value}"

    # -- calibration ----------------------------------------------------------------------------
    def _new_observer(self):
        granularity = PerChannel(self.axis) if self.axis is not None else PerTensor()
        return make_observer(self.recipe.method, granularity, **dict(self.recipe.options))

    def observe(self, x: torch.Tensor) -> None:
        if self.observer is None:
            self.observer = self._new_observer()
        x = x.detach()
        if self.observe_bounds is not None:
            x = x.clamp(*self.observe_bounds)
        try:
            self.observer.update(x)
        except ValueError as e:
            raise ValueError(f"{self.kind} {self.name!r}: {e}") from None

    def freeze(self) -> None:
        """Turn the observed range into frozen scale / zero point (with the tensor's name in errors)."""
        if self.observer is None:
            raise ValueError(
                f"{self.kind} {self.name!r} saw no data during calibration: the calibration batches"
                " never reached this tensor (a branch not taken?). Calibrate with inputs that"
                " exercise it, or skip the layer with a Rule(pattern=..., skip=True)"
            )
        try:
            scale, zero_point = self.observer.qparams(self.scheme)
        except ValueError as e:
            raise ValueError(f"{self.kind} {self.name!r}: {e}") from None
        self._check_move(QState.FROZEN)
        self._write_qparams(scale, zero_point)
        self._move(QState.FROZEN)

    def set_qparams(self, scale, zero_point) -> None:
        """Fix ``scale`` / ``zero_point`` (a calibrating quantizer becomes frozen; a tracking or
        learned one keeps its state and continues from these values). ``ValueError`` naming the
        quantizer for a scale that is not finite and positive or a zero point off the grid."""
        self._write_qparams(scale, zero_point)
        if self._state is QState.CALIBRATING:
            self._move(QState.FROZEN)

    def _write_qparams(self, scale, zero_point) -> None:
        scale = np.asarray(scale.detach().cpu() if torch.is_tensor(scale) else scale)
        zero_point = np.asarray(
            zero_point.detach().cpu() if torch.is_tensor(zero_point) else zero_point
        )
        self._check_qparams(scale, zero_point)
        scale = torch.as_tensor(scale.astype(np.float32))
        zero_point = torch.as_tensor(np.rint(zero_point).astype(np.int32))
        device = self.scale.device
        if self._state is QState.LEARNED:
            with torch.no_grad():
                self.log_scale.data = torch.log(scale).to(device)
                if isinstance(self.zero_point, nn.Parameter):
                    self.zero_point.data = zero_point.float().to(device)
                else:
                    self.zero_point = zero_point.to(device)
            self.scale = scale.to(device)
        else:
            self.scale = scale.to(device)
            self.zero_point = zero_point.to(device)
        self.__dict__.pop("_cache", None)  # WeightQuantizer's calibration-time copy

    def _check_qparams(self, scale: np.ndarray, zero_point: np.ndarray) -> None:
        what = f"{self.kind} quantizer {self.name!r}"
        if scale.dtype.kind not in "biuf" or not (np.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"{what}: scale must be finite and > 0, got {scale.tolist()}")
        if zero_point.dtype.kind not in "biuf" or not np.isfinite(zero_point).all():
            raise ValueError(f"{what}: zero point must be finite, got {zero_point.tolist()}")
        if (zero_point != np.rint(zero_point)).any() or (
            (zero_point < self.qmin) | (zero_point > self.qmax)
        ).any():
            raise ValueError(
                f"{what}: zero point must be an integer in [{self.qmin}, {self.qmax}], got "
                f"{zero_point.tolist()}"
            )
        if zero_point.size not in (1, scale.size):
            raise ValueError(
                f"{what}: {scale.size} scales but {zero_point.size} zero points; give one zero "
                "point per scale"
            )

    # -- forward --------------------------------------------------------------------------------
    def _exporting(self) -> bool:
        """Inside ``export_mode``: the context has prepared this quantizer's export tensors."""
        return "export_scale" in self._buffers

    # what ``forward``'s export branch reads besides its tensors (their names are read too):
    # quantizers of one class with equal values trace to one export graph, so the export traces
    # it once (``onnx.exporter._reuse._form``; a method here is called). A class that defines
    # ``forward`` states its own; one that does not is traced quantizer by quantizer.
    export_reads = ("enabled", "_state", "qmin", "qmax", "axis")

    def forward(self, x: torch.Tensor, observe: bool = True) -> torch.Tensor:
        if not self.enabled:
            return x
        state = self._state
        if state is QState.CALIBRATING:
            if observe:
                self.observe(x)
            return x
        if self._exporting():
            return torch.ops.quantbridge.quantize_dequantize(
                x, self.export_scale, self.export_zero_point, self.qmin, self.qmax, self.axis
            )
        if state is QState.LEARNED:
            zero_point = (
                self.zero_point if self.zero_point.is_floating_point() else self.zero_point.float()
            )
            return LearnedStepSTE.apply(
                x, self.learned_scale(), zero_point, self.qmin, self.qmax, self.axis
            )
        if state is QState.TRACKING and self.training and observe:
            self._track(x)
        return FakeQuantizeSTE.apply(
            x, self.scale, self.zero_point, self.qmin, self.qmax, self.axis
        )

    def quantize_integers(self, x: torch.Tensor) -> torch.Tensor:
        """Integer codes of ``x`` (float tensor holding integers) with the current parameters."""
        return quantize(
            x.detach(),
            self.current_scale(),
            self.integer_zero_point(),
            self.qmin,
            self.qmax,
            self.axis,
        )
