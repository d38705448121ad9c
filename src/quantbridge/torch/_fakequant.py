"""Fake quantization in torch: the straight-through estimator and the quantizer modules.

A ``Quantizer`` is one quantization point in a captured graph (an activation, a weight). It has
three states:

* observing (``observing=True``): the tensor passes through unchanged while an observer from
  ``quantbridge.calibrate`` accumulates its range (float calibration, as ONNX Runtime and
  PyTorch do);
* quantizing (after ``freeze()``): ``fake_quantize`` with the frozen ``scale``/``zero_point``
  buffers, gradients by the clipped straight-through estimator;
* disabled (``enabled=False``): identity - the float model, same weights.

Weight quantizers derive their parameters from the weight itself (per-channel minmax over the
current weight) every time while ``observing`` and keep them fixed once frozen.

A ``BiasQuantizer`` quantizes a bias to int32 with ``scale = input_scale * weight_scale`` taken from
the two quantizers of its op, so the exported int32 bias is exactly what torch used.

In export mode (see ``quantbridge.torch._export_ops``) the quantizers emit the custom ops that the
ONNX exporter translates into QuantizeLinear / DequantizeLinear, with integer weights precomputed.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from ..calibrate import make_observer
from ..numerics import (
    PerChannel,
    PerTensor,
    QScheme,
    bias_scale,
    choose_qparams,
    dequantize,
    fake_quantize,
    quantize,
    quantize_bias,
)
from ..recipe import TensorRecipe


class FakeQuantizeSTE(torch.autograd.Function):
    """Fake quantization with the clipped straight-through estimator.

    Forward: ``y = (clip(round(x / s) + z, qmin, qmax) - z) * s`` (``numerics.fake_quantize``).

    Backward: ``dL/dx = dL/dy * 1[(qmin - z) * s <= x <= (qmax - z) * s]`` - rounding is treated as
    identity inside the representable range and the gradient is zero where the value saturates.
    No gradient flows to ``scale`` or ``zero_point`` (fixed-range quantizers).
    """

    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin: int, qmax: int, axis: int | None):
        if ctx.needs_input_grad[0]:  # the mask is all backward needs: one bool per element
            param_axis = None if scale.ndim == 0 else 0
            lo = dequantize(torch.full_like(scale, qmin), scale, zero_point, param_axis)
            hi = dequantize(torch.full_like(scale, qmax), scale, zero_point, param_axis)
            lo, hi = _along(lo, x.ndim, axis), _along(hi, x.ndim, axis)
            ctx.save_for_backward((x >= lo) & (x <= hi))
        return fake_quantize(x, scale, zero_point, qmin, qmax, axis)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask, None, None, None, None, None


def _reduce_to(t: torch.Tensor, like: torch.Tensor, axis: int | None) -> torch.Tensor:
    """Sum ``t`` down to the shape of a per-tensor (``()``) or per-channel (``(C,)``) parameter."""
    if like.ndim == 0:
        return t.sum()
    dims = [d for d in range(t.ndim) if d != axis % t.ndim]
    return t.sum(dim=dims)


def _along(p: torch.Tensor, ndim: int, axis: int | None) -> torch.Tensor:
    if p.ndim == 0:
        return p
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return p.reshape(shape)


class LearnedStepSTE(torch.autograd.Function):
    """Fake quantization with a learned step size and offset (LSQ, Esser et al. 2020; LSQ+,
    Bhalgat et al. 2020).

    Forward: ``y = numerics.fake_quantize(x, s, z, qmin, qmax)`` with the integer zero point
    ``z = clip(round(z_f), qmin, qmax)`` of the learned float offset ``z_f``.

    Backward, with ``t = x / s``, ``q = round(t) + z`` and ``inside = qmin <= q <= qmax``:

    * ``dy/dx   = 1[inside]``
    * ``dy/ds   = g * (round(t) - t)`` inside, ``g * (qmin - z)`` below, ``g * (qmax - z)`` above
    * ``dy/dz_f = 0`` inside, ``-s`` outside (straight through the rounding of ``z_f``)

    where ``g = 1 / sqrt(n * qmax)`` is LSQ's gradient scale (``n`` = elements per scale).
    """

    @staticmethod
    def forward(ctx, x, scale, zero_point_f, qmin: int, qmax: int, axis: int | None):
        z = zero_point_f.detach().round().clamp(qmin, qmax)
        s = scale.detach()
        y = fake_quantize(x, s, z, qmin, qmax, axis)
        if any(ctx.needs_input_grad[:3]):
            sb, zb = _along(s, x.ndim, axis), _along(z, x.ndim, axis)
            t = x.detach() / sb
            codes = torch.round(t) + zb
            below, above = codes < qmin, codes > qmax
            codes.clamp_(qmin, qmax)
            ctx.save_for_backward(t, codes, below, above, s, z)
        ctx.qmin, ctx.qmax, ctx.axis = qmin, qmax, axis
        return y

    @staticmethod
    def backward(ctx, grad):
        t, codes, below, above, scale, z = ctx.saved_tensors
        axis, qmax = ctx.axis, ctx.qmax
        outside = below | above
        inside = ~outside
        zb = _along(z, t.ndim, axis)
        # inside: round(t) - t = (codes - z) - t ; outside: codes - z is qmin - z or qmax - z
        ds = (codes - zb) - t * inside
        n = t.numel() / max(scale.numel(), 1)
        g = 1.0 / math.sqrt(n * max(abs(qmax), 1))
        grad_scale = _reduce_to(grad * ds, scale, axis) * g
        grad_zero = None
        if ctx.needs_input_grad[2]:
            grad_zero = -_reduce_to(grad * outside, scale, axis) * scale
        return grad * inside, grad_scale, grad_zero, None, None, None


class Quantizer(nn.Module):
    """One quantization point: observe, then fake-quantize with frozen parameters."""

    def __init__(self, name: str, recipe: TensorRecipe, kind: str, axis: int | None = None):
        super().__init__()
        self.name = name  # user-facing: '<module path>:<tensor>'
        self.kind = kind  # 'activation', 'weight' or 'constant'
        self.scheme: QScheme = recipe.scheme
        self.recipe = recipe
        self.axis = axis if isinstance(recipe.scheme.granularity, PerChannel) else None
        self.enabled = True
        self.observing = True  # calibration: pass through and observe
        self.tracking = False  # QAT: fake-quantize and follow the batch range (moving average)
        self.learnable = False  # QAT: scale (and asymmetric zero point) are Parameters (LSQ)
        self.export_mode = False
        self.observer = None
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("zero_point", torch.zeros((), dtype=torch.int32))
        # persisted twin of ``observing`` (a Python flag, so that export never branches on data)
        self.register_buffer("calibrated", torch.zeros((), dtype=torch.uint8))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Accept per-channel shapes from a checkpoint, and restore the calibrated state."""
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
        self.observing = not bool(self.calibrated)

    # -- QAT ------------------------------------------------------------------------------------
    def make_learnable(self) -> None:
        """LSQ: learn the step size, as ``log_scale`` (a Parameter; ``scale = exp(log_scale)``
        stays positive and Adam's per-step change is relative, as in TQT, Jain et al. 2020),
        and an asymmetric scheme's zero point as a float offset. Initialised from the current
        values; the ``scale`` buffer keeps the value in use for export and the int32 bias."""
        if self.learnable:
            return
        self.log_scale = nn.Parameter(torch.log(self.scale.detach().clone()))
        if not self.scheme.symmetric:
            zero_point = self.zero_point.detach().float()
            del self.zero_point
            self.zero_point = nn.Parameter(zero_point)
        self.learnable = True
        self.tracking = False

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
        """Moving-average min/max of the batch (constant 0.01), then new scale / zero point."""
        with torch.no_grad():
            lo, hi = x.detach().min().double(), x.detach().max().double()
            from ._distributed import ddp_batch_range  # here: _distributed imports this module

            lo, hi = ddp_batch_range(lo, hi)  # inside DDP: min / max over every rank's batch
            if not hasattr(self, "_ema"):
                self._ema = (lo, hi)
            else:
                self._ema = tuple(
                    e + 0.01 * (v - e) for e, v in zip(self._ema, (lo, hi), strict=False)
                )
            scale, zero_point = choose_qparams(
                self._ema[0].cpu().numpy(), self._ema[1].cpu().numpy(), self.scheme
            )
            self.set_qparams(scale, zero_point)

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
        state = "observing" if self.observing else "frozen"
        return f"{self.name!r}, {sign}{s.bits} [{s.qmin}, {s.qmax}], {gran}, {state}"

    # -- calibration ----------------------------------------------------------------------------
    def _new_observer(self):
        granularity = PerChannel(self.axis) if self.axis is not None else PerTensor()
        return make_observer(self.recipe.method, granularity, **dict(self.recipe.options))

    def observe(self, x: torch.Tensor) -> None:
        if self.observer is None:
            self.observer = self._new_observer()
        try:
            self.observer.update(x.detach())
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
        self.set_qparams(scale, zero_point)

    def set_qparams(self, scale, zero_point) -> None:
        scale = torch.as_tensor(np.asarray(scale, dtype=np.float32))
        zero_point = torch.as_tensor(np.asarray(zero_point, dtype=np.int32))
        assert torch.isfinite(scale).all() and (scale > 0).all(), (self.name, scale)
        self.scale = scale.to(self.scale.device)
        self.zero_point = zero_point.to(self.scale.device)
        self.calibrated.fill_(1)
        self.observing = False
        self.__dict__.pop("_cache", None)  # WeightQuantizer's calibration-time copy

    # -- forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, observe: bool = True) -> torch.Tensor:
        if not self.enabled:
            return x
        if self.observing:
            if observe:
                self.observe(x)
            return x
        if self.export_mode:
            return torch.ops.quantbridge.quantize_dequantize(
                x, self.export_scale, self.export_zero_point, self.qmin, self.qmax, self.axis
            )
        if self.learnable:
            zero_point = (
                self.zero_point if self.zero_point.is_floating_point() else self.zero_point.float()
            )
            return LearnedStepSTE.apply(
                x, self.learned_scale(), zero_point, self.qmin, self.qmax, self.axis
            )
        if self.tracking and self.training and observe:
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


class WeightQuantizer(Quantizer):
    """Per-channel (or per-tensor) weight quantizer; range taken from the weight itself."""

    def __init__(self, name: str, recipe: TensorRecipe, axis: int):
        super().__init__(name, recipe, "weight", axis)

    def compute_from(self, w: torch.Tensor) -> None:
        obs = self._new_observer()
        try:
            obs.update(w.detach())
            scale, zero_point = obs.qparams(self.scheme)
        except ValueError as e:
            raise ValueError(f"weight {self.name!r}: {e}") from None
        self.set_qparams(scale, zero_point)

    def forward(self, w: torch.Tensor, observe: bool = True) -> torch.Tensor:
        if not self.enabled:
            return w
        if self.export_mode:
            return torch.ops.quantbridge.dequantize(
                self.export_qweight, self.export_scale, self.export_zero_point, self.axis
            )
        if self.learnable:
            zero_point = (
                self.zero_point if self.zero_point.is_floating_point() else self.zero_point.float()
            )
            return LearnedStepSTE.apply(
                w, self.learned_scale(), zero_point, self.qmin, self.qmax, self.axis
            )
        if self.observing:
            cached = self._observed_cache(w)
            if cached is not None:
                return cached
            # weights need no calibration data: parameters follow the current weight (QAT)
            scale, zero_point = _weight_qparams(w.detach(), self.scheme, self.axis)
            self.scale, self.zero_point = scale, zero_point
            out = FakeQuantizeSTE.apply(w, scale, zero_point, self.qmin, self.qmax, self.axis)
            if not torch.is_grad_enabled() and w.is_leaf:
                self.__dict__["_cache"] = (w, w._version, w.data_ptr(), scale, zero_point, out)
            return out
        return FakeQuantizeSTE.apply(
            w, self.scale, self.zero_point, self.qmin, self.qmax, self.axis
        )

    def _observed_cache(self, w: torch.Tensor) -> torch.Tensor | None:
        """The fake-quantized weight of the previous no-grad call, if ``w`` is unchanged since.

        Calibration runs many batches through weights that do not change: their range and
        fake-quantized copy are computed once (bit-identical; 10-20% of a ResNet-18 calibration).
        "Unchanged" = the same leaf tensor, same version counter (bumped by every in-place
        write), same storage. Gradient-enabled calls (QAT) never use or fill the cache.
        """
        cache = self.__dict__.get("_cache")
        if cache is None or torch.is_grad_enabled():
            return None
        if cache[0] is not w or cache[1] != w._version or cache[2] != w.data_ptr():
            self.__dict__.pop("_cache", None)
            return None
        self.scale, self.zero_point = cache[3], cache[4]
        return cache[5]


class ConstantQuantizer(Quantizer):
    """The constant operand of a quantized add / mul (a Python scalar or a buffer) on its own
    per-tensor grid, so that export writes it as an integer initializer -> DequantizeLinear, like a
    weight: ONNX Runtime fuses ``DQ -> Add/Mul -> Q`` into QLinearAdd / QLinearMul only when every
    input is a DequantizeLinear (a float initializer keeps the op in float). ORT's own quantizer
    does the same.

    Scheme: the op's activation scheme, per tensor - QLinearAdd / QLinearMul take one integer type
    for both inputs and the output, so a constant in the weight scheme (int8 against uint8
    activations) would not fuse (measured, ORT 1.32: ``Mul(DQ(uint8), DQ(int8)) -> Q`` stays a
    float Mul, ``Mul(DQ(uint8), DQ(uint8)) -> Q`` becomes QLinearMul). Parameters: ``choose_qparams`` over the constant's own
    ``[min, max]``, computed once at placement; a constant never observes, tracks or learns.

    For a scalar ``c`` that range is ``[min(c, 0), max(c, 0)]``: ``scale = |c| / n`` with ``n`` the
    codes between the zero point and the end of the grid (``qmax`` for a zero point of 0, e.g.
    ``c > 0``; 255 - 0 for ``c < 0`` with asymmetric uint8, whose zero point is then 255), and the
    code is that end, so ``c`` is represented up to float32 rounding: ``scale`` is ``|c| / n``
    rounded to float32 and the dequantized ``n * scale`` rounded once more, which can land one ulp
    from ``c`` (measured: at most 1 ulp over 40,000 random scalars of magnitude 1e-4..1e4, uint8
    asymmetric and int8 symmetric). Acceptable: ``c`` is itself a float32 rounding of the model's
    literal and ``x * c`` is rounded again in float32, so this is float32's own error, about 16
    bits below the activation's step (2**-8 of its range). Below ``|c| = n * 2**-23`` the scale
    is held at ``numerics.MIN_SCALE`` and ``c`` is represented to within 2**-24 absolute. With a
    ``pow2`` scale constraint the scale is rounded up to a power of two and ``c`` is represented
    only to that step, as the scheme asks.

    ``constant_name`` is the qualified name of the constant's buffer in the model (a scalar lives
    in this module's own ``value`` buffer); export reads the integers from it.
    """

    def __init__(self, name: str, recipe: TensorRecipe, value: torch.Tensor, own: bool = False):
        super().__init__(name, recipe, "constant")
        if own:  # a Python scalar: the module holds it (the placement's get_attr reads it)
            self.register_buffer("value", value.detach().clone())
        self.constant_name = ""  # set by placement once the module has its attribute name
        v = value.detach().double()
        self.set_qparams(*choose_qparams(v.min().cpu().numpy(), v.max().cpu().numpy(), self.scheme))

    def freeze(self) -> None:
        """Nothing to do: the parameters were fixed from the constant at placement."""

    def make_learnable(self) -> None:
        """Constants do not train, nor does their grid."""

    def forward(self, c: torch.Tensor, observe: bool = True) -> torch.Tensor:
        if not self.enabled:
            return c
        if self.export_mode:
            return torch.ops.quantbridge.dequantize(
                self.export_qvalue, self.export_scale, self.export_zero_point, None
            )
        return FakeQuantizeSTE.apply(c, self.scale, self.zero_point, self.qmin, self.qmax, None)


def _weight_qparams(w: torch.Tensor, scheme: QScheme, axis: int | None):
    if axis is None:
        lo, hi = w.min(), w.max()
    else:
        dims = [d for d in range(w.ndim) if d != axis % w.ndim]
        lo, hi = w.amin(dim=dims), w.amax(dim=dims)
    scale, zero_point = choose_qparams(lo.double().cpu().numpy(), hi.double().cpu().numpy(), scheme)
    return torch.as_tensor(scale, device=w.device), torch.as_tensor(zero_point, device=w.device)


class BiasQuantizer(nn.Module):
    """int32 bias with ``scale = input_scale * weight_scale`` (float32 product), zero point 0.

    Codes by ``numerics.quantize_bias``; gradient straight through (identity). Holds plain references (not submodules) to the input and
    weight quantizers of its op; identity until both are frozen.
    """

    def __init__(self, name: str, input_quantizer: Quantizer, weight_quantizer: WeightQuantizer):
        super().__init__()
        self.name = name
        self.__dict__["input_quantizer"] = input_quantizer
        self.__dict__["weight_quantizer"] = weight_quantizer
        self.enabled = True
        self.export_mode = False

    def active(self) -> bool:
        iq, wq = self.input_quantizer, self.weight_quantizer
        return self.enabled and iq.enabled and wq.enabled and not iq.observing and iq.axis is None

    def bias_scale(self) -> torch.Tensor:
        return torch.as_tensor(
            bias_scale(self.input_quantizer.current_scale(), self.weight_quantizer.current_scale())
        )

    def integer_bias(self, b: torch.Tensor) -> torch.Tensor:
        """int32 codes by ``numerics.quantize_bias``, exactly what export stores."""
        return torch.as_tensor(
            quantize_bias(
                b, self.input_quantizer.current_scale(), self.weight_quantizer.current_scale()
            )
        )

    def forward(self, b: torch.Tensor) -> torch.Tensor:
        if not self.active():
            return b
        if self.export_mode:
            return torch.ops.quantbridge.dequantize(
                self.export_qbias, self.export_scale, self.export_zero_point, self.export_axis
            )
        scale = self.bias_scale().to(b.device)
        axis = 0 if scale.numel() > 1 else None
        deq = dequantize(self.integer_bias(b).to(b.device), scale, torch.zeros_like(scale), axis)
        return b + (deq - b).detach()  # straight-through: d(out)/d(b) = 1


def quantizer_modules(model: nn.Module):
    for m in model.modules():
        if isinstance(m, (Quantizer, BiasQuantizer)):
            yield m
