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
keep their placement. A zero pad before a quantized op (a float op's output -> pad -> conv) counts
as a reader that reads float: the value is quantized before the pad, which keeps its grid.
"""

from __future__ import annotations

import torch

from ..recipe import Recipe
from ._nodes import module_of
from ._ops import (
    PAD_OPS,
    PAD_OWN_GRID,
    WEIGHTED_OPS,
    Role,
    op_role,
    reads_as_divisor,
    tensor_args,
)
from ._scope import scoped_role

aten = torch.ops.aten
# Averages the integer program computes on codes: a float value a pool reads, whose output is
# quantized, is quantized before the pool (HF EfficientNet's final ``silu -> AvgPool2d -> linear``)
_POOLS = frozenset({aten.mean.dim, aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default})
_PASS = (Role.DATA_MOVEMENT, Role.IDENTITY_IN_EVAL)


def quantizer_of(user: torch.fx.Node, value: torch.fx.Node, scope: str) -> torch.fx.Node | None:
    """The op that quantizes ``value`` as ``user`` reads it: ``user`` when it is a weighted op's
    activation input or a (non-divisor) input of an arithmetic op; through a zero pad (it keeps the
    grid, ``_ops.PAD_OPS``), a reader of the pad's output (HF EfficientNet's ``ZeroPad2d`` before
    its stride-2 depthwise convs); None when nothing quantizes it there. Skips: the caller's."""
    role = scoped_role(user, scope)
    if role is Role.WEIGHTED:
        return user if user.args[WEIGHTED_OPS[user.target][0]] is value else None
    if role is Role.ARITHMETIC:
        inputs = [v for _, v in tensor_args(user)]
        return user if value in inputs and not reads_as_divisor(user, value) else None
    if _zero_pad(user) and user.args[0] is value:
        return next((q for u in user.users if (q := quantizer_of(u, user, scope))), None)
    if user.op == "call_function" and user.target in _POOLS and user.args[0] is value:
        return _quantized_after(user, scope)
    return None


def _quantized_after(pool: torch.fx.Node, scope: str) -> torch.fx.Node | None:
    """The op quantizing ``pool``'s output, through data movement and dropout (to a linear)."""
    for user in pool.users:
        if op_role(user) in _PASS and user.args and user.args[0] is pool:
            q = _quantized_after(user, scope)
        else:
            q = quantizer_of(user, pool, scope)
        if q is not None:
            return q
    return None


def _zero_pad(node: torch.fx.Node) -> bool:
    pad = PAD_OPS.get(node.target) if node.op == "call_function" else None
    return pad is not None and pad(node) and not node.meta.get(PAD_OWN_GRID)


def keeps_float(user: torch.fx.Node, recipe: Recipe) -> bool:
    """``user`` reads a value float whatever the fan-out: a layer a recipe rule skips, or the
    graph output with ``quantize_outputs=False`` (as ``_ops.read_only_as_graph_output``)."""
    if user.op == "output":
        return not recipe.quantize_outputs
    return user.op == "call_function" and recipe.for_module(*module_of(user))[0]


def fan_out_readers(value: torch.fx.Node, recipe: Recipe) -> tuple[list, torch.fx.Node | None]:
    """(the readers of ``value`` to read it quantized, the first op that quantizes it) when a
    reader quantizes ``value`` and another (or a zero pad before a quantized op) would read it
    float (readers that ``keeps_float`` set aside; a zero pad or an average pool whose output is
    quantized counts as a float reader); ([], None) otherwise: a divisor among the readers
    (it stays float, see ``_ops.DIVISOR_INPUTS``), or every reader quantizing it itself (they share
    one quantizer already, as the readers of a transformer's layer norm do: nothing changes), or a
    recipe with smoothquant."""
    users = list(value.users)
    if recipe.smoothquant or any(reads_as_divisor(u, value) for u in users):
        # smoothquant: a value read by a linear and a float op is divided per channel for the
        # linear (its Case 3); quantizing it before the fan-out would put its outlier channels on
        # the linear's grid again (tests/torch/test_ptq_smoothquant.py: OutlierLayer, Block)
        return [], None
    kept = [u for u in users if not keeps_float(u, recipe)]
    quantizers = [quantizer_of(u, value, recipe.activation_scope) for u in kept]
    reads_float = [u for u, q in zip(kept, quantizers, strict=True) if q is not u]
    first = next((q for q in quantizers if q is not None), None)
    if first is None or not reads_float:
        return [], None
    return kept, first
