"""The activation scope ``"weighted_inputs"`` (``Recipe.activation_scope``): the roles placement
gives ops when only the activations that weighted ops and matmuls read are quantized.

Under ``"all"`` (the default) every op role of ``_ops.op_role`` applies. Under
``"weighted_inputs"`` (the layout NNCF's ``model_type=TRANSFORMER`` writes):

* WEIGHTED ops (conv, conv-transpose, linear, addmm): activation input, weight and int32 bias are
  quantized, the output is not;
* matmul / bmm / mm (``MATMUL_OPS``): every operand that depends on an input is quantized, the
  softmax's probabilities included (the scores stay float, so there is no ``DQ -> Softmax -> Q``
  for ONNX Runtime to fuse into its inexact QLinearSoftmax); the output is float, so
  ``feeds_float_input_only`` (masked scores) does not apply;
* every other op is FLOAT: adds, muls, concats, norms, softmax, activations, and data movement
  (no grid flows through it: each quantized read is placed where the weighted op reads).

One tensor, one quantizer: a value a weighted op reads through pure data movement (view,
transpose, permute, slicing, max-pool, eval-mode dropout: ``_ops.DATA_MOVEMENT_OPS``,
``IDENTITY_IN_EVAL_OPS``) is quantized by the quantizer of the value it was moved from
(``moved_from``), so ``k`` and ``k.transpose(-2, -1)``, or a hidden state read as it is and
reshaped, share one scale and zero point, as the "all" scope's grid propagation gives them.

For matmul-shaped models (transformers) only: ONNX Runtime runs an int8 MatMul with a float
output, but no int8 Conv with a float output, so a CNN's convolutions whose outputs are not
quantized run in float there (ResNet-18-style: 12 of 21 convs float; docs/attention.md).

Not integer-only: the element-wise ops between the quantized reads run in float, so ``qb.lower``
and ``integer_mode`` refuse such a model (``onnx`` / ``integer`` layers say which op).
"""

from __future__ import annotations

import torch

from ._ops import Role, op_role

aten = torch.ops.aten

# activation x activation products: both operands quantized under "weighted_inputs"
MATMUL_OPS: frozenset = frozenset({aten.matmul.default, aten.bmm.default, aten.mm.default})
_MOVES = (Role.DATA_MOVEMENT, Role.IDENTITY_IN_EVAL)


def scoped_role(node: torch.fx.Node, scope: str) -> Role:
    """``op_role(node)`` under the activation scope ``scope`` (see the module docstring)."""
    role = op_role(node)
    if scope == "all" or role is Role.WEIGHTED:
        return role
    if node.op == "call_function" and node.target in MATMUL_OPS:
        return Role.ARITHMETIC
    return Role.FLOAT


def moved_from(value: torch.fx.Node) -> torch.fx.Node:
    """The value ``value`` is a pure data movement of (through any chain of them), else itself."""
    while op_role(value) in _MOVES and value.args and isinstance(value.args[0], torch.fx.Node):
        value = value.args[0]
    return value
