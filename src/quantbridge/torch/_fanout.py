"""Fan-out: which reader of a float value quantizes it, so that placement quantizes the value
once, before the fan-out, for every reader (``_placement``: ``_Planner.fan_out``).

A float op's output read by a quantized op and by another op - EfficientNet's and MobileNetV3's
squeeze-excite, ``x * sigmoid(fc2(relu(fc1(avgpool(x)))))`` with ``x = silu(conv(...))`` - used
to be quantized where the quantized op (the ``mul``) reads it while the pool read the float value:
no integer program could be lowered from such a model (the pool's input had no QuantizeLinear).
Quantizing the value for all readers puts the pool on the same codes as the multiply. Readers
that read float on purpose still do: a layer a recipe rule skips, a divisor, and the graph output
with ``quantize_outputs=False``. A value whose readers all quantize it is left as it was (they
already share one quantizer), so transformers' layer norms, read by linears and residual adds,
keep their placement.
"""

from __future__ import annotations

import torch

from ..recipe import Recipe
from ._nodes import module_of
from ._ops import WEIGHTED_OPS, Role, reads_as_divisor, tensor_args
from ._scope import scoped_role


def quantizing_reader(user: torch.fx.Node, value: torch.fx.Node, scope: str) -> bool:
    """``user`` quantizes ``value`` where it reads it: a weighted op's activation input, or a
    (non-divisor) input of an arithmetic op. Recipe skips are the caller's to check."""
    role = scoped_role(user, scope)
    if role is Role.WEIGHTED:
        return user.args[WEIGHTED_OPS[user.target][0]] is value
    if role is Role.ARITHMETIC:
        inputs = [v for _, v in tensor_args(user)]
        return value in inputs and not reads_as_divisor(user, value)
    return False


def keeps_float(user: torch.fx.Node, recipe: Recipe) -> bool:
    """``user`` reads a value float whatever the fan-out: a layer a recipe rule skips, or the
    graph output with ``quantize_outputs=False`` (as ``_ops.read_only_as_graph_output``)."""
    if user.op == "output":
        return not recipe.quantize_outputs
    return user.op == "call_function" and recipe.for_module(*module_of(user))[0]


def fan_out_readers(value: torch.fx.Node, recipe: Recipe) -> tuple[list, torch.fx.Node | None]:
    """(the readers of ``value`` to read it quantized, the first that quantizes it) when ``value``
    fans out to a reader that quantizes it and to one that would read it float (not ``keeps_float``);
    ([], None) otherwise: one reader, a divisor among them (it stays float, see
    ``_ops.DIVISOR_INPUTS``), or every reader quantizing it (they share one quantizer already, as
    the readers of a transformer's layer norm do: nothing changes there)."""
    users = list(value.users)
    if len(users) < 2 or any(reads_as_divisor(u, value) for u in users):
        return [], None
    kept = [u for u in users if not keeps_float(u, recipe)]
    quantizing = [u for u in kept if quantizing_reader(u, value, recipe.activation_scope)]
    if not quantizing or len(quantizing) == len(users):
        return [], None
    return kept, quantizing[0]
