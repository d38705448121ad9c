"""Dynamic quantization of an activation: ``DynamicQuantizer`` and its export op.

ONNX's ``DynamicQuantizeLinear`` quantizes a tensor to uint8 with the scale and zero point of that
call's own range (``[min(x, 0), max(x, 0)]``). A model imported from a dynamically quantized file
(ONNX Runtime's ``quantize_dynamic``) holds one ``DynamicQuantizer`` per such tensor, in the
``QuantModel``'s quantizer container like any quantizer, so that

* ``float_mode`` / ``set_quantization(False)`` bypass it (``enabled``);
* ``qb.save`` / ``qb.load`` keep it (it has a quantizer's state, always frozen: nothing is learned,
  tracked or calibrated: ``freeze``, ``track`` and ``make_learnable`` do nothing);
* export writes it back as ``DynamicQuantizeLinear -> DequantizeLinear``: inside ``export_mode`` it
  emits the custom op ``quantbridge::dynamic_quantize_dequantize``, which the ONNX translation table
  turns into those two nodes.

The arithmetic is ``dynamic_fake_quantize`` (the formulas are ``numerics.choose_qparams`` and
``numerics.fake_quantize``); the gradient is the identity (the range covers every value).
"""

from __future__ import annotations

import torch

from ..numerics import QScheme, choose_qparams, fake_quantize
from ..recipe import TensorRecipe
from ._quantizer import QState, Quantizer

UINT8_DYNAMIC = QScheme(8, signed=False, symmetric=False)


def dynamic_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """``DynamicQuantizeLinear`` then dequantization, as ONNX Runtime computes it per call: uint8,
    ``[lo, hi] = [min(x, 0), max(x, 0)]`` of the whole tensor, scale and zero point by
    ``numerics.choose_qparams`` (asymmetric uint8: ``s = (hi - lo) / 255``,
    ``z = clip(-round(lo / s), 0, 255)``), then ``numerics.fake_quantize``."""
    lo, hi = x.detach().min(), x.detach().max()
    scale, zero_point = choose_qparams(
        lo.double().cpu().numpy(), hi.double().cpu().numpy(), UINT8_DYNAMIC
    )
    scale_t = torch.as_tensor(scale, device=x.device)
    zero_t = torch.as_tensor(zero_point, dtype=torch.float32, device=x.device)
    return fake_quantize(x, scale_t, zero_t, 0, 255, None)


@torch.library.custom_op("quantbridge::dynamic_quantize_dequantize", mutates_args=())
def dynamic_quantize_dequantize(x: torch.Tensor) -> torch.Tensor:
    """The export op of ``DynamicQuantizer`` (ONNX: DynamicQuantizeLinear -> DequantizeLinear)."""
    return dynamic_fake_quantize(x)


@dynamic_quantize_dequantize.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


dynamic_quantize_dequantize.register_autograd(lambda ctx, grad: grad)


class DynamicQuantizer(Quantizer):
    """A tensor quantized with each call's own range (see the module docstring)."""

    def __init__(self, name: str):
        super().__init__(name, TensorRecipe(UINT8_DYNAMIC), "dynamic")
        self._set_state(QState.FROZEN)  # nothing to calibrate; scale / zero point unused

    def freeze(self) -> None:
        """Nothing to do: every call computes its own parameters."""

    def track(self) -> None:
        """Nothing to track: every call computes its own parameters."""

    def make_learnable(self) -> None:
        """Nothing to learn: every call computes its own parameters."""

    def extra_repr(self) -> str:
        return f"{self.name!r}, uint8 [0, 255], per-tensor, dynamic (each call's range)"

    export_reads = ("enabled",)  # (``Quantizer.export_reads``)

    def forward(self, x: torch.Tensor, observe: bool = True) -> torch.Tensor:
        if not self.enabled:
            return x
        if self._exporting():
            return torch.ops.quantbridge.dynamic_quantize_dequantize(x)
        return dynamic_quantize_dequantize(x)
