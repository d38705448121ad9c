"""The ``Site`` op of a normalised quantized graph (``_quantized``), as the float import runs it.

``Site(x)`` marks a value the file quantizes onto grid ``grid``. In the float module it is the
identity, recorded by ``torch.export`` as the custom op ``quantbridge_import::site`` so that
``_qmodel`` finds every site in the captured graph and puts the grid's quantizer there.
"""

from __future__ import annotations

import torch

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
