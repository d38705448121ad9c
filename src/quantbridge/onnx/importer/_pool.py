"""Pooling ops of ``import_onnx``: MaxPool, AveragePool, GlobalAverage/MaxPool, LRN.

Symmetric ``pads`` no larger than half the (dilated) kernel are torch's own ``padding``; other
pads are applied explicitly first (``-inf`` for max pooling; zeros for average pooling, whose
divisor then counts only real pixels unless ``count_include_pad=1``, by dividing by the pooled
padding mask). ONNX's ``count_include_pad`` defaults to 0, torch's to True: always passed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._nn import geometry, onnx_pads, static_padding, torch_pads
from ._registry import OnnxNode, register

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _pool_padding(node: OnnxNode, x, kernel, strides, dilations):
    """(x padded explicitly if the torch op cannot, torch padding, explicit ONNX pads or None)."""
    k = len(kernel)
    padding = static_padding(node, k)
    fits = padding is not None and all(
        2 * p <= (kernel[i] - 1) * dilations[i] + 1 for i, p in enumerate(padding)
    )
    if fits:
        return padding, None
    return (0,) * k, onnx_pads(node, x, kernel, strides, dilations)


def _check_max_pool(node: OnnxNode) -> None:
    if len(node.outputs) > 1 and node.outputs[1]:
        raise ValueError(f"{node.where()}: the Indices output of MaxPool is not supported")


@register("MaxPool", check=_check_max_pool)
def _max_pool(node, x):
    kernel = list(node.attr("kernel_shape"))
    strides, dilations = geometry(node, kernel)
    padding, explicit = _pool_padding(node, x, kernel, strides, dilations)
    if explicit is not None:
        x = F.pad(x, torch_pads(explicit), value=-math.inf)
    pool = _MAX_POOL[len(kernel)]
    return pool(x, kernel, strides, padding, dilations, ceil_mode=bool(node.attr("ceil_mode", 0)))


def _check_avg_pool(node: OnnxNode) -> None:
    if any(d != 1 for d in node.attr("dilations", [])):
        raise ValueError(f"{node.where()}: dilated AveragePool has no torch equivalent")


@register("AveragePool", check=_check_avg_pool)
def _avg_pool(node, x):
    kernel = list(node.attr("kernel_shape"))
    strides, dilations = geometry(node, kernel)
    padding, explicit = _pool_padding(node, x, kernel, strides, dilations)
    include = bool(node.attr("count_include_pad", 0))
    ceil = bool(node.attr("ceil_mode", 0))
    pool = _AVG_POOL[len(kernel)]
    if explicit is None:
        return pool(x, kernel, strides, padding, ceil, include)
    pads = torch_pads(explicit)
    y = pool(F.pad(x, pads), kernel, strides, 0, ceil, True)
    if include:
        return y
    ones = F.pad(torch.ones_like(x[:1, :1]), pads)
    return y / pool(ones, kernel, strides, 0, ceil, True)


@register("GlobalAveragePool")
def _global_avg_pool(node, x):
    return x.mean(tuple(range(2, node.rank(0, x))), keepdim=True)


@register("GlobalMaxPool")
def _global_max_pool(node, x):
    return x.amax(tuple(range(2, node.rank(0, x))), keepdim=True)


def _check_lrn(node: OnnxNode) -> None:
    if node.attr("size") % 2 == 0:
        raise ValueError(
            f"{node.where()}: LRN with an even size ({node.attr('size')}) windows the channels "
            "differently from torch's local_response_norm; only odd sizes are supported"
        )


@register("LRN", check=_check_lrn)
def _lrn(node, x):
    # ONNX: x / (bias + alpha / size * sum of squares over the window) ** beta == torch's
    return F.local_response_norm(
        x,
        node.attr("size"),
        node.attr("alpha", 1e-4),
        node.attr("beta", 0.75),
        node.attr("bias", 1.0),
    )
