"""The kinds of quantizer placed in a captured graph, on top of ``Quantizer`` (``_quantizer``: the
state machine, calibration, tracking, LSQ) and the straight-through estimators (``_ste``):

* ``WeightQuantizer`` - per-channel (or per-tensor) weight; its range is taken from the weight;
* ``StackedWeightQuantizer`` - stacked MoE experts ``[E, O, K]``, per (expert, output channel);
* ``BlockWeightQuantizer`` - group-wise weight of an imported file (``PerBlock``: one scale and
  zero point per ``block_size`` elements along ``axis``), parameters fixed;
* ``ConstantQuantizer`` - the constant operand of an add / mul, on its own grid;
* ``BiasQuantizer`` - int32 bias with ``scale = input_scale * weight_scale`` taken from the two
  quantizers of its op, so the exported int32 bias is exactly what torch used.

The names of ``_quantizer`` and ``_ste`` are re-exported here (``from ._fakequant import ...``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..numerics import QScheme, bias_scale, choose_qparams, dequantize, quantize, quantize_bias
from ..recipe import TensorRecipe
from ._quantizer import QState, Quantizer
from ._ste import FakeQuantizeSTE, LearnedStepSTE

__all__ = [
    "BiasQuantizer",
    "BlockWeightQuantizer",
    "ConstantQuantizer",
    "FakeQuantizeSTE",
    "LearnedStepSTE",
    "QState",
    "Quantizer",
    "StackedWeightQuantizer",
    "WeightQuantizer",
    "quantizer_modules",
]


class WeightQuantizer(Quantizer):
    """Per-channel (or per-tensor) weight quantizer; range taken from the weight itself."""

    def __init__(self, name: str, recipe: TensorRecipe, axis: int):
        super().__init__(name, recipe, "weight", axis)

    def __getstate__(self) -> dict:
        """``pickle`` and ``copy.deepcopy``: the float weight AdaRound kept (``keep_float_weight``)
        travels with its parameter and is recorded again on the copy, whose parameter's version
        counter starts afresh; a stale one (the parameter written since) is left behind."""
        state = dict(self.__dict__)
        state.pop("_rounded_weight", None)  # only inside float_mode
        kept = state.pop("_float_weight", None)
        if kept is not None and kept[0]._version == kept[2]:
            state["_float_weight_copied"] = kept[:2]
        return state

    def __setstate__(self, state: dict) -> None:
        kept = state.pop("_float_weight_copied", None)
        super().__setstate__(state)
        if kept is not None:
            param, weight = kept
            self.__dict__["_float_weight"] = (param, weight, param._version)

    def compute_from(self, w: torch.Tensor) -> None:
        obs = self._new_observer()
        try:
            obs.update(w.detach())
            scale, zero_point = obs.qparams(self.scheme)
        except ValueError as e:
            raise ValueError(f"weight {self.name!r}: {e}") from None
        self.set_qparams(scale, zero_point)

    export_reads = ("enabled", "axis")  # (``Quantizer.export_reads``)

    def forward(self, w: torch.Tensor, observe: bool = True) -> torch.Tensor:
        if not self.enabled:
            return w
        if self._exporting():
            return torch.ops.quantbridge.dequantize(
                self.export_qweight, self.export_scale, self.export_zero_point, self.axis
            )
        rounded = self.__dict__.get("_rounded_weight")
        if rounded is not None:  # enabled inside float_mode, which swapped the float weight in
            return rounded  # (``keep_float_weight``): AdaRound's rounding, not a new one
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


class StackedWeightQuantizer(WeightQuantizer):
    """The weights of stacked experts, a parameter ``[E, O, K]`` (``out_axis`` 1) or ``[E, K, O]``
    (``out_axis`` 2) that HF mixture-of-experts layers gather per token (``_experts``): one scale
    per (expert, output channel). The parameter is viewed as ``[E * O, K]`` (``flat``) and
    quantized per channel along axis 0 there, so scales, codes, the export (``DequantizeLinear``
    of ``[E * O, K]`` with axis 0, then a reshape back) and the checkpoint are those of a 2-D
    per-channel weight; ``axis`` is 0 (of the flat view), ``out_axis`` the parameter's."""

    def __init__(self, name: str, recipe: TensorRecipe, out_axis: int):
        super().__init__(name, recipe, 0)
        self.out_axis = out_axis

    def flat(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` as ``[E * O, K]``, rows in (expert, output channel) order."""
        return w.movedim(self.out_axis, 1).reshape(w.shape[0] * w.shape[self.out_axis], -1)

    def _unflat(self, f: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return f.reshape(w.movedim(self.out_axis, 1).shape).movedim(1, self.out_axis)

    def compute_from(self, w: torch.Tensor) -> None:
        super().compute_from(self.flat(w))

    def forward(self, w: torch.Tensor, observe: bool = True) -> torch.Tensor:
        if not self.enabled:
            return w
        return self._unflat(super().forward(self.flat(w), observe), w)

    def quantize_integers(self, x: torch.Tensor) -> torch.Tensor:
        """The codes of the flat view ``[E * O, K]`` (what export stores)."""
        return super().quantize_integers(self.flat(x))

    def quantize_flat(self, f: torch.Tensor) -> torch.Tensor:
        """The codes of ``f``, already flat (``[E * O, K]``, or its per-row extremes)."""
        return super().quantize_integers(f)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", stacked experts (output axis {self.out_axis})"


class BlockWeightQuantizer(WeightQuantizer):
    """Group-wise weight quantizer: ``scale`` and ``zero_point`` have the weight's rank, with
    ``ceil(n / block_size)`` blocks along ``axis`` (ONNX opset 21 blocked quantization; element
    ``i`` along ``axis`` uses block ``i // block_size``, ``numerics.expand_blocks``).

    Forward: ``numerics.fake_quantize(w, s, z, qmin, qmax, axis, block_size)`` with the clipped
    straight-through gradient (``FakeQuantizeSTE``, its mask on the codes). The parameters come
    from a file (``qb.import_onnx``) and stay fixed: the weight trains on the file's grid. A
    scale may be negative (ONNX Runtime's symmetric block quantizer), never zero.
    """

    def __init__(self, name: str, recipe: TensorRecipe, axis: int, block_size: int):
        super().__init__(name, recipe, axis)
        self.axis, self.block_size = axis, int(block_size)

    def _refuse(self, what: str) -> None:
        raise ValueError(
            f"weight quantizer {self.name!r} is group-wise (block_size {self.block_size}): its "
            f"scales come from the imported file and stay fixed; {what} is not supported for "
            "blocked weights (train the weights on the file's grid, or quantize the float model "
            "per channel with qb.quantize)"
        )

    def compute_from(self, w: torch.Tensor) -> None:
        self._refuse("computing scales from the weight")

    def make_learnable(self) -> None:
        self._refuse("learning the scales (LSQ, learn_scales=True)")

    def track(self) -> None:
        self._refuse("tracking the weight range (QAT)")

    export_reads = ("enabled", "axis", "block_size")  # (``Quantizer.export_reads``)

    def forward(self, w: torch.Tensor, observe: bool = True) -> torch.Tensor:
        if not self.enabled:
            return w
        if self._exporting():
            return torch.ops.quantbridge.dequantize_blocked(
                self.export_qweight, self.export_scale, self.export_zero_point, self.axis,
                self.block_size,
            )  # fmt: skip
        return FakeQuantizeSTE.apply(
            w, self.scale, self.zero_point, self.qmin, self.qmax, self.axis, self.block_size
        )

    def quantize_integers(self, x: torch.Tensor) -> torch.Tensor:
        zero_point = self.integer_zero_point()
        return quantize(x.detach(), self.scale, zero_point, self.qmin, self.qmax, self.axis,
                        self.block_size)  # fmt: skip

    def _check_qparams(self, scale, zero_point) -> None:
        if scale.dtype.kind in "f" and np.isfinite(scale).all() and (scale != 0).all():
            scale = np.abs(scale)  # negative block scales are valid (see the class docstring)
        super()._check_qparams(scale, zero_point)

    def extra_repr(self) -> str:
        s = self.scheme
        sign = "int" if s.signed else "uint"
        return (f"{self.name!r}, {sign}{s.bits} [{s.qmin}, {s.qmax}], per-block(axis={self.axis},"
                f" block_size={self.block_size}), {self.qstate.value}")  # fmt: skip


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

    ``axis`` (with a per-channel scheme): one grid per slice along ``axis``, as an imported file's
    per-channel constant (``DequantizeLinear(codes, scales, zero points, axis)``) has it.

    ``constant_name`` is the qualified name of the constant's buffer in the model (a scalar lives
    in this module's own ``value`` buffer); export reads the integers from it.
    """

    def __init__(
        self,
        name: str,
        recipe: TensorRecipe,
        value: torch.Tensor,
        own: bool = False,
        axis: int | None = None,
    ):
        super().__init__(name, recipe, "constant", axis)
        if own:  # a Python scalar: the module holds it (the placement's get_attr reads it)
            self.register_buffer("value", value.detach().clone())
        self.constant_name = ""  # set by placement once the module has its attribute name
        # per channel (``axis``, a per-channel scheme): an imported file's constant on its grid
        self.set_qparams(*_weight_qparams(value.detach(), self.scheme, self.axis))

    def freeze(self) -> None:
        """Nothing to do: the parameters were fixed from the constant at placement."""

    def make_learnable(self) -> None:
        """Constants do not train, nor does their grid."""

    export_reads = ("enabled", "axis")  # (``Quantizer.export_reads``)

    def forward(self, c: torch.Tensor, observe: bool = True) -> torch.Tensor:
        if not self.enabled:
            return c
        if self._exporting():
            return torch.ops.quantbridge.dequantize(
                self.export_qvalue, self.export_scale, self.export_zero_point, self.axis
            )
        return FakeQuantizeSTE.apply(
            c, self.scale, self.zero_point, self.qmin, self.qmax, self.axis
        )


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

    def use_input_quantizer(self, quantizer: Quantizer) -> None:
        """Take the bias scale from ``quantizer`` (placement merged the op's input quantizer)."""
        self.__dict__["input_quantizer"] = quantizer

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

    export_reads = ("active", "export_axis")  # (``Quantizer.export_reads``)

    def forward(self, b: torch.Tensor) -> torch.Tensor:
        if not self.active():
            return b
        if "export_scale" in self._buffers:  # inside export_mode (see Quantizer._exporting)
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
