"""Standalone batch norms as depthwise 1x1 convolutions, so they run on integers.

A batch norm that follows no conv / linear (DenseNet's pre-activation ``BN -> ReLU -> conv``,
LeViT's ``BatchNorm1d`` after ``Linear -> flatten``, RepVGG's identity branch) cannot be folded
(``_passes.fold_batchnorm``). In inference it is a per-channel affine map

.. math::
   k = \\gamma / \\sqrt{\\sigma^2 + \\epsilon},\\quad y = k \\cdot x + (\\beta - \\mu k)

which is exactly a depthwise convolution with a 1x1 kernel (``groups = C``, weight ``k``
reshaped to ``(C, 1, 1...)``, bias ``beta - mu k``). As a WEIGHTED op it gets the usual
quantization: per-channel int8 weight (one value per channel, so the per-channel scale holds
``k`` exactly: code +-qmax), int32 bias, quantized input and output - ONNX Runtime runs it as a
QLinearConv, where a float BatchNormalization would stop the integer chain on both sides.

``batchnorm_as_conv`` rewrites every inference-mode ``batch_norm`` left in the graph (run it after
``fold_batchnorm``): inputs of 3, 4, 5 dims become conv1d / conv2d / conv3d; a 2-D input (N, C)
becomes ``unsqueeze(-1) -> conv1d -> squeeze(-1)``. The new parameters live beside the batch
norm's own, as ``<bn>.affine_weight`` / ``<bn>.affine_bias``. Batch norms in training mode (QAT
before ``freeze_batchnorm``) are left alone. The float result is unchanged up to float32 rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from ._passes import _NotFoldable, _owner, _param, finish

aten = torch.ops.aten

_CONV_BY_NDIM = {3: aten.conv1d.default, 4: aten.conv2d.default, 5: aten.conv3d.default}


def batchnorm_as_conv(gm: torch.fx.GraphModule) -> int:
    """Rewrite every inference-mode batch_norm of ``gm`` as a depthwise 1x1 conv; the count."""
    done = 0
    for bn in list(gm.graph.nodes):
        if bn.op != "call_function" or bn.target is not aten.batch_norm.default or bn.args[5]:
            continue
        val = bn.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.ndim not in (2, 3, 4, 5):
            continue
        try:
            _rewrite(gm, bn, val)
        except _NotFoldable:
            continue
        done += 1
    return finish(gm, done)


def _rewrite(gm: torch.fx.GraphModule, bn: torch.fx.Node, val: torch.Tensor) -> None:
    x, gamma_n, beta_n, mean_n, var_n = bn.args[:5]
    gamma, beta, mean, var = (_param(gm, a) for a in (gamma_n, beta_n, mean_n, var_n))
    if mean is None or var is None:
        raise _NotFoldable
    eps = float(bn.args[7])
    with torch.no_grad():
        k = torch.rsqrt(var.double() + eps)
        if gamma is not None:
            k = k * gamma.double()
        bias = (beta.double() if beta is not None else 0.0) - mean.double() * k
    ndim = max(val.ndim, 3)
    weight = k.to(val.dtype).reshape(-1, *([1] * (ndim - 1)))
    owner, _ = _owner(gm, mean_n.target)
    prefix = mean_n.target.rpartition(".")[0]
    names, trains = [], gamma is not None and gamma.requires_grad
    for attr, value in (("affine_weight", weight), ("affine_bias", bias.to(val.dtype))):
        owner.register_parameter(attr, nn.Parameter(value, requires_grad=trains))
        names.append(f"{prefix}.{attr}" if prefix else attr)
    graph = gm.graph
    n = ndim - 2
    with graph.inserting_before(bn):
        w_node, b_node = graph.get_attr(names[0]), graph.get_attr(names[1])
        src = x
        if val.ndim == 2:
            src = _call(graph, bn, aten.unsqueeze.default, (x, -1), x.meta["val"].unsqueeze(-1))
        conv_args = (src, w_node, b_node, [1] * n, [0] * n, [1] * n, weight.shape[0])
        out_val = src.meta["val"] if val.ndim == 2 else val
        out = _call(graph, bn, _CONV_BY_NDIM[ndim], conv_args, out_val)
        if val.ndim == 2:
            out = _call(graph, bn, aten.squeeze.dim, (out, -1), val)
    w_node.meta["val"], b_node.meta["val"] = weight, bias.to(val.dtype)
    bn.replace_all_uses_with(out)
    graph.erase_node(bn)


def _call(graph: torch.fx.Graph, like: torch.fx.Node, target, args: tuple, val) -> torch.fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = val
    node.meta["nn_module_stack"] = like.meta.get("nn_module_stack", {})
    return node
