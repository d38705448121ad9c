"""Fold a constant affine map that follows a conv / linear into that layer's weight and bias.

Re-parameterised blocks end a layer with a constant scale and shift: PP-LCNetV3's
``LearnableAffineBlock`` (``conv -> x * s -> + t``, one scalar each), layer scale (``x * gamma[c]``),
a ``BN`` exported as ``Mul`` + ``Add`` by older converters. Quantized as captured, each of those
ops gets its own output grid: three roundings where the deployed layer needs one. With

.. math::
   y = (W x + b) \\cdot k + t = (W \\cdot k) x + (b \\cdot k + t)

(``k``, ``t`` scalars or one value per output channel, broadcast along the weight's
output-channel axis as in ``_passes.fold_batchnorm``), ``fold_affine`` rewrites the weight and
bias and removes the ``mul`` / ``div`` (``k = 1 / d``) / ``add`` / ``sub`` (``t = -c``), in any
order and number, while the layer's output feeds only that op. The float result is unchanged up
to float32 rounding (the products are formed in float64).

Constants are Python numbers or tensors that do not train (a ``requires_grad`` parameter is left
alone: folding it would stop it learning in QAT). A tensor folds only when it holds one value or
one per output channel and the result keeps the layer's output shape. Like BN folding, new tensors
are made, never written in place (the captured ones are the user's model's).
"""

from __future__ import annotations

import torch
from torch import nn

from ._ops import TRANSPOSED_CONV_OPS, WEIGHTED_OPS
from ._passes import _NotFoldable, _owner, _param, _unwrap, finish

aten = torch.ops.aten

# weighted ops whose output channels are the output's last dimension (else dimension 1)
_LAST = frozenset({aten.linear.default})
_FOLDS = frozenset(WEIGHTED_OPS) - {aten.addmm.default, aten.baddbmm.default}
# op -> (scale, shift) as functions of the constant c; only ``x op c`` for div and sub
_AFFINE = {
    aten.mul.Tensor: (lambda c: c, None),
    aten.div.Tensor: (lambda c: 1.0 / c, None),
    aten.add.Tensor: (None, lambda c: c),
    aten.sub.Tensor: (None, lambda c: -c),
}
_COMMUTES = frozenset({aten.mul.Tensor, aten.add.Tensor})


def fold_affine(gm: torch.fx.GraphModule) -> int:
    """Fold every constant mul/div/add/sub after a conv/linear into it; how many ops went."""
    folded = 0
    for layer in list(gm.graph.nodes):
        if layer.op != "call_function" or layer.target not in _FOLDS:
            continue
        while len(layer.users) == 1:
            (op,) = layer.users
            try:
                scale, shift = _constants(gm, layer, op)
                _fold(gm, layer, scale, shift)
            except _NotFoldable:
                break
            op.replace_all_uses_with(layer)
            gm.graph.erase_node(op)
            folded += 1
    return finish(gm, folded)


def _constants(gm, layer: torch.fx.Node, op: torch.fx.Node) -> tuple:
    """(scale, shift) of ``op`` as one value per output channel (float64), one of them None."""
    return affine_constants(gm, layer, op, layer.target in _LAST)


def affine_constants(gm, x: torch.fx.Node, op: torch.fx.Node, last: bool) -> tuple:
    """(scale, shift) of ``op`` applied to ``x`` (float64, one value or one per channel; channels
    on ``x``'s last axis when ``last``, else axis 1), one of them None; else ``_NotFoldable``."""
    if op.op != "call_function" or op.target not in _AFFINE or op.kwargs.get("alpha", 1) != 1:
        raise _NotFoldable
    if len(op.args) != 2:
        raise _NotFoldable
    a, b = op.args
    if a is x and b is not x:
        other = b
    elif b is x and a is not x and op.target in _COMMUTES:
        other = a
    else:
        raise _NotFoldable
    c = _value(gm, other)
    out, val = x.meta.get("val"), op.meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(val, torch.Tensor):
        raise _NotFoldable
    if val.shape != out.shape or val.dtype != out.dtype or c.ndim > out.ndim:
        raise _NotFoldable  # the constant broadcasts the output to a new shape or dtype
    if out.ndim < 2:
        raise _NotFoldable
    axis = out.ndim - 1 if last else 1
    shape = [1] * (out.ndim - c.ndim) + list(c.shape)
    if any(n != 1 for i, n in enumerate(shape) if i != axis):
        raise _NotFoldable  # varies along batch or space: not one value per channel
    c = c.reshape(-1)
    scale_of, shift_of = _AFFINE[op.target]
    return (scale_of(c) if scale_of else None), (shift_of(c) if shift_of else None)


def _value(gm, arg) -> torch.Tensor:
    if isinstance(arg, bool) or not isinstance(arg, (int, float, torch.fx.Node)):
        raise _NotFoldable
    if not isinstance(arg, torch.fx.Node):
        return torch.tensor([float(arg)], dtype=torch.float64)
    if _unwrap(arg) is not arg:
        raise _NotFoldable  # a quantized constant (QAT): its grid is the model's
    t = _param(gm, arg)
    if not isinstance(t, torch.Tensor) or t.requires_grad or not t.is_floating_point():
        raise _NotFoldable
    return t.detach().double()


def _fold(gm, layer: torch.fx.Node, scale, shift) -> None:
    _, i_w, i_b, axis = WEIGHTED_OPS[layer.target]
    if layer.target in TRANSPOSED_CONV_OPS and len(layer.args) > 6 and layer.args[6] != 1:
        raise _NotFoldable  # grouped transposed conv: out channels are not one weight axis
    w_node, w, b_node, b = layer_tensors(gm, layer, i_w, i_b)
    channels = w.shape[axis]
    for c in (scale, shift):
        if c is not None and c.numel() not in (1, channels):
            raise _NotFoldable
    with torch.no_grad():
        new_b = b.double() if b is not None else torch.zeros(channels, dtype=torch.float64)
        new_w = None
        if scale is not None:
            shape = [1] * w.ndim
            shape[axis] = -1
            k = scale.expand(channels)
            new_w = (w.double() * k.reshape(shape)).to(w.dtype)
            new_b = new_b * k
        if shift is not None:
            new_b = new_b + shift.expand(channels)
    write_folded(gm, layer, (w_node, w, new_w), (b_node, b, new_b), i_b)


def layer_tensors(gm, layer: torch.fx.Node, i_w: int, i_b: int) -> tuple:
    """(weight node, weight, bias node or None, bias or None) of ``layer``, when a fold may
    rewrite them: plain parameters (not quantized: QAT), each read by this layer only;
    else ``_NotFoldable``."""
    w_node = layer.args[i_w]
    b_node = layer.args[i_b] if len(layer.args) > i_b else None
    for node in (w_node,) if b_node is None else (w_node, b_node):
        if not isinstance(node, torch.fx.Node) or _unwrap(node) is not node:
            raise _NotFoldable
        if len(node.users) != 1 or _shared(gm, node):
            raise _NotFoldable  # a tensor another layer reads too
    return w_node, _param(gm, w_node), b_node, _param(gm, b_node)


def write_folded(gm, layer: torch.fx.Node, weight: tuple, bias: tuple, i_b: int) -> None:
    """Store a fold's result: ``weight`` and ``bias`` are (node, old tensor, new tensor or None);
    a layer without a bias gets a new ``<weight>_folded_bias`` parameter at argument ``i_b``."""
    w_node, w, new_w = weight
    b_node, b, new_b = bias
    if new_w is not None:
        owner, attr = _owner(gm, w_node.target)
        setattr(owner, attr, nn.Parameter(new_w, requires_grad=w.requires_grad))
    if new_b is None:
        return
    if b is not None:
        b_owner, b_attr = _owner(gm, b_node.target)
        setattr(b_owner, b_attr, nn.Parameter(new_b.to(w.dtype), requires_grad=b.requires_grad))
        return
    owner, attr = _owner(gm, w_node.target)
    prefix = w_node.target.rpartition(".")[0]
    name = f"{attr}_folded_bias"
    owner.register_parameter(name, nn.Parameter(new_b.to(w.dtype), requires_grad=w.requires_grad))
    with gm.graph.inserting_after(w_node):
        b_node = gm.graph.get_attr(f"{prefix}.{name}" if prefix else name)
    args = list(layer.args) + [None] * (i_b + 1 - len(layer.args))
    args[i_b] = b_node
    layer.args = tuple(args)


def _shared(gm, node: torch.fx.Node) -> bool:
    """Whether another get_attr reads the same attribute (one tensor, two layers)."""
    return any(
        n is not node and n.op == "get_attr" and n.target == node.target for n in gm.graph.nodes
    )
