"""The ``Site`` op of a normalised quantized graph (``_quantized``), as the float import runs it.

``Site(x)`` marks a value the file quantizes onto grid ``grid``. In the float module it is the
identity, recorded by ``torch.export`` as the custom op ``quantbridge_import::site`` so that
``_qmodel`` finds every site in the captured graph and puts the grid's quantizer there.

``DynamicSite(x)`` is ``DynamicQuantizeLinear`` (scale and zero point from each call's range) and
its dequantization: the custom op ``quantbridge_import::dynamic_site`` stays in the imported
model as it is (it has no state to train, save or set).
"""

from __future__ import annotations

import torch

from ...numerics import QScheme, choose_qparams, fake_quantize
from ._registry import OnnxNode, OpHandler


@torch.library.custom_op("quantbridge_import::site", mutates_args=())
def site(x: torch.Tensor, grid: int, observe: int) -> torch.Tensor:
    """Identity (a copy: a custom op may not return its input)."""
    return x.clone()


@site.register_fake
def _(x: torch.Tensor, grid: int, observe: int) -> torch.Tensor:
    return torch.empty_like(x)


site.register_autograd(lambda ctx, grad: (grad, None, None))

SITE_TARGET = torch.ops.quantbridge_import.site.default


def _run(node: OnnxNode, x: torch.Tensor) -> torch.Tensor:
    return site(x, int(node.attr("grid")), int(node.attr("observe", 1)))


SITE_HANDLER = OpHandler("Site", 1, _run)


# -- dynamic quantization ----------------------------------------------------------------------
_UINT8 = QScheme(8, signed=False, symmetric=False)


def dynamic_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """``DynamicQuantizeLinear`` then dequantization, as ONNX Runtime computes it per call: uint8,
    ``[lo, hi] = [min(x, 0), max(x, 0)]`` of the whole tensor, scale and zero point by
    ``numerics.choose_qparams`` (asymmetric uint8: ``s = (hi - lo) / 255``,
    ``z = clip(-round(lo / s), 0, 255)``), then ``numerics.fake_quantize``."""
    lo, hi = x.detach().min(), x.detach().max()
    scale, zero_point = choose_qparams(lo.double().cpu().numpy(), hi.double().cpu().numpy(), _UINT8)
    scale_t = torch.as_tensor(scale, device=x.device)
    zero_t = torch.as_tensor(zero_point, dtype=torch.float32, device=x.device)
    return fake_quantize(x, scale_t, zero_t, 0, 255, None)


@torch.library.custom_op("quantbridge_import::dynamic_site", mutates_args=())
def dynamic_site(x: torch.Tensor) -> torch.Tensor:
    """The imported model's dynamic quantizer (identity gradient: the range covers every value)."""
    return dynamic_fake_quantize(x)


@dynamic_site.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


dynamic_site.register_autograd(lambda ctx, grad: grad)

DYNAMIC_SITE_TARGET = torch.ops.quantbridge_import.dynamic_site.default


def _run_dynamic(node: OnnxNode, x: torch.Tensor) -> torch.Tensor:
    return dynamic_site(x)


DYNAMIC_SITE_HANDLER = OpHandler("DynamicSite", 1, _run_dynamic)
