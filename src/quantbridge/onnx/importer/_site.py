"""The ``Site`` op of a normalised quantized graph (``_quantized``), as the float import runs it.

``Site(x)`` marks a value the file quantizes onto grid ``grid``. In the float module it is the
identity, recorded by ``torch.export`` as the custom op ``quantbridge_import::site`` so that
``_qmodel`` finds every site in the captured graph and puts the grid's quantizer there.

``DynamicSite(x)`` is ``DynamicQuantizeLinear`` (scale and zero point from each call's range) and
its dequantization: the custom op ``quantbridge_import::dynamic_site``, which ``_qmodel`` replaces
by a ``DynamicQuantizer`` (``torch/_dynamic.py``) of the ``QuantModel``.
"""

from __future__ import annotations

import torch

from ...torch._dynamic import dynamic_fake_quantize
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
@torch.library.custom_op("quantbridge_import::dynamic_site", mutates_args=())
def dynamic_site(x: torch.Tensor) -> torch.Tensor:
    """The float import's dynamic quantization (identity gradient: the range covers every value)."""
    return dynamic_fake_quantize(x)


@dynamic_site.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


dynamic_site.register_autograd(lambda ctx, grad: grad)

DYNAMIC_SITE_TARGET = torch.ops.quantbridge_import.dynamic_site.default


def _run_dynamic(node: OnnxNode, x: torch.Tensor) -> torch.Tensor:
    return dynamic_site(x)


DYNAMIC_SITE_HANDLER = OpHandler("DynamicSite", 1, _run_dynamic)
