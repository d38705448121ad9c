"""The ``Site`` op of a normalised quantized graph (``_quantized``), as the float import runs it.

``Site(x)`` marks a value the file quantizes onto grid ``grid``. In the float module it is the
identity, recorded by ``torch.export`` as the custom op ``quantbridge_import::site`` so that
``_qmodel`` finds every site in the captured graph and puts the grid's quantizer there.

``DynamicSite(x)`` is ``DynamicQuantizeLinear`` (scale and zero point from each call's range) and
its dequantization: the custom op ``quantbridge::dynamic_quantize_dequantize`` of
``torch/_dynamic.py`` (the export op of ``DynamicQuantizer``; one op for both), which ``_qmodel``
replaces by a ``DynamicQuantizer`` of the ``QuantModel``.
"""

from __future__ import annotations

import numpy as np
import torch

from ...torch._dynamic import dynamic_quantize_dequantize
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


def _run(node: OnnxNode, x: torch.Tensor | np.ndarray) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):  # a host value: a constant table gathered at positions
        x = torch.from_numpy(np.ascontiguousarray(x))  # of a static Slice (TorchScript BERT)
    return site(x, int(node.attr("grid")), int(node.attr("observe", 1)))


SITE_HANDLER = OpHandler("Site", 1, _run)


# -- dynamic quantization ----------------------------------------------------------------------
DYNAMIC_SITE_TARGET = torch.ops.quantbridge.dynamic_quantize_dequantize.default


def _run_dynamic(node: OnnxNode, x: torch.Tensor) -> torch.Tensor:
    return dynamic_quantize_dequantize(x)


DYNAMIC_SITE_HANDLER = OpHandler("DynamicSite", 1, _run_dynamic)
