"""Fold a constant affine map that feeds a conv / linear into that layer's weight and bias.

The mirror of ``_fold_affine`` on the input side: PP-LCNetV3 ends every activation with a constant
scale and shift (``hardswish -> x * s -> + t -> conv``), and models that normalise their input
inside the graph start with ``(x - mean) / std -> conv``. Quantized as captured, the scaled and the
shifted tensors each get a grid of their own before the layer reads the last one. With the
constants ``k`` (scale) and ``t`` (shift) one value or one per input channel ``c``,

.. math::
   W (k \\odot x + t) + b = (W \\cdot k_c) x + (b + \\textstyle\\sum_{c, s} W_{o,c,s}\\, t_c)

so the weight is scaled along its input-channel axis (within each group of a grouped conv) and
the shift moves into the bias. A shift folds only into a conv without padding (the padded border
would read ``t`` where the layer reads 0) and into linear layers; a scale folds into any conv, its
zero padding unchanged. Ops fold from the layer backwards (``add`` first, then the ``mul`` before
it), each only while it feeds nothing but the layer; ``x``'s other readers are untouched.
Transposed convolutions are left alone. The float result is unchanged up to float32 rounding.
"""

from __future__ import annotations

import torch

from ._fold_affine import affine_constants, layer_tensors, write_folded
from ._passes import _NotFoldable, _unwrap, finish
from .ptq._graph import conv_geometry, groups_of

aten = torch.ops.aten

_CONVS = frozenset({aten.conv1d.default, aten.conv2d.default, aten.conv3d.default})
_LINEAR = aten.linear.default


def fold_affine_inputs(gm: torch.fx.GraphModule) -> int:
    """Fold every constant mul/div/add/sub feeding a conv/linear into it; how many ops went."""
    folded = 0
    for layer in list(gm.graph.nodes):
        if layer.op != "call_function" or (layer.target not in _CONVS and layer.target != _LINEAR):
            continue
        while True:
            op = layer.args[0]
            if not isinstance(op, torch.fx.Node) or len(op.users) != 1 or op.op != "call_function":
                break
            x = _tensor_operand(op)
            try:
                scale, shift = affine_constants(gm, x, op, layer.target == _LINEAR)
                _fold(gm, layer, scale, shift)
            except _NotFoldable:
                break
            layer.args = (x, *layer.args[1:])
            gm.graph.erase_node(op)
            folded += 1
    return finish(gm, folded)


def _tensor_operand(op: torch.fx.Node):
    nodes = [a for a in op.args if isinstance(a, torch.fx.Node)]
    if len(nodes) == 2:  # x * c with c a get_attr: the operand that is not a constant
        nodes = [a for a in nodes if _unwrap(a).op != "get_attr"]
    return nodes[0] if len(nodes) == 1 else None


def _fold(gm, layer: torch.fx.Node, scale, shift) -> None:
    w_node, w, b_node, b = layer_tensors(gm, layer, 1, 2)
    groups = groups_of(layer)
    if layer.target in _CONVS and shift is not None and any(conv_geometry(layer, w.ndim - 2)[1]):
        raise _NotFoldable  # padded: the border would read t where the layer reads zeros
    out_c, in_g = w.shape[0], w.shape[1]
    channels = in_g * groups
    for c in (scale, shift):
        if c is not None and c.numel() not in (1, channels):
            raise _NotFoldable
    # per (output channel, input channel of its group): the input channel's constant
    index = (torch.arange(out_c)[:, None] // (out_c // groups)) * in_g + torch.arange(in_g)
    with torch.no_grad():
        w64 = w.double()
        new_b = b.double() if b is not None else torch.zeros(out_c, dtype=torch.float64)
        spread = [1] * (w.ndim - 2)
        if shift is not None:
            t = shift.expand(channels)[index]
            new_b = new_b + (w64 * t.reshape(out_c, in_g, *spread)).sum(tuple(range(1, w.ndim)))
        new_w = None
        if scale is not None:
            k = scale.expand(channels)[index]
            new_w = (w64 * k.reshape(out_c, in_g, *spread)).to(w.dtype)
    write_folded(gm, layer, (w_node, w, new_w), (b_node, b, None if shift is None else new_b), 2)
