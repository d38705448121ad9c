"""``linear_products``: a product of an activation and a transposed 2-D parameter, ``x @ w.T``,
as the ``aten.linear`` it computes, so that the op tables quantize it as a layer.

Hugging Face Falcon's ``FalconLinear(nn.Linear)`` overrides ``forward`` with
``input @ self.weight.T`` (then ``+ self.bias``): captured as ``matmul(x, numpy_T(w))``, a
product with a constant operand, which placement leaves float (``_ops.CONSTANT_OPERAND_OPS``).
Every linear layer of a Falcon model ran in float without a word. Rewritten, as
``F.linear(x, w, b) = x @ w.T + b`` computes:

1. ``matmul(x, T(w))`` or ``mm(x, T(w))``, ``w`` a 2-D float parameter or buffer and ``T`` a swap
   of its two axes (``numpy_T``, ``t``, ``permute(w, [1, 0])``, ``transpose(w, 0, 1)``), becomes
   ``linear(x, w)``;
2. its only reader ``add(linear, b)`` (or ``add(b, linear)``, no ``alpha``), ``b`` a 1-D float
   parameter or buffer with one value per output feature, becomes the linear's bias
   (``linear(x, w, b)``): an int32 bias on the accumulator instead of a quantized add.

The product node is rewritten in place (its name, ``nn_module_stack`` and fake value stay), so the
user's layer names are unchanged. A product of an untransposed parameter (``x @ self.proj``,
OpenAI CLIP) is left as captured (placement names it: ``_ops.unquantized_weighted_reason``).
"""

from __future__ import annotations

import torch

from ._passes import finish

aten = torch.ops.aten
_PRODUCTS = frozenset({aten.matmul.default, aten.mm.default})


def linear_products(gm: torch.fx.GraphModule) -> int:
    """Rewrite every ``x @ w.T`` of ``gm`` as ``linear(x, w)`` (bias folded); the count."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _PRODUCTS:
            continue
        w = _transposed_parameter(gm, node.args[1])
        if w is None or not _is_float(node.args[0]):
            continue
        node.target, node.args, node.kwargs = aten.linear.default, (node.args[0], w), {}
        _fold_bias(gm, node)  # Case 2
        done += 1
    return finish(gm, done)


def _constant(gm: torch.fx.GraphModule, node, ndim: int) -> torch.Tensor | None:
    """The float parameter / buffer of get_attr ``node`` when it has ``ndim`` dimensions."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    prefix, _, attr = str(node.target).rpartition(".")
    value = getattr(gm.get_submodule(prefix) if prefix else gm, attr, None)
    ok = isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == ndim
    return value if ok else None


def _transposed_parameter(gm: torch.fx.GraphModule, node) -> torch.fx.Node | None:
    """``w`` when ``node`` is ``T(w)`` of a 2-D float parameter or buffer (Case 1)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or not node.args:
        return None
    w = node.args[0]
    if _constant(gm, w, 2) is None:
        return None
    if node.target in (aten.numpy_T.default, aten.t.default):
        return w
    if node.target is aten.permute.default and list(node.args[1]) == [1, 0]:
        return w
    if node.target is aten.transpose.int and {d % 2 for d in node.args[1:3]} == {0, 1}:
        return w
    return None


def _is_float(node) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _fold_bias(gm: torch.fx.GraphModule, linear: torch.fx.Node) -> None:
    users = list(linear.users)
    if len(users) != 1:
        return
    add = users[0]
    if add.op != "call_function" or add.target is not aten.add.Tensor or add.kwargs:
        return
    if len(add.args) != 2:
        return
    bias = add.args[1] if add.args[0] is linear else add.args[0]
    b = _constant(gm, bias, 1)
    w = _constant(gm, linear.args[1], 2)
    if b is None or b.shape[0] != w.shape[0] or b.dtype != w.dtype or bias is linear:
        return
    linear.args = (*linear.args, bias)
    add.replace_all_uses_with(linear)
    gm.graph.erase_node(add)
