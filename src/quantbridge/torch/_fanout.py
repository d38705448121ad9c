"""Fan-out: which reader of a float value quantizes it, so that placement quantizes the value
once, before the fan-out, for every reader (``_placement``: ``_Planner.fan_out``).

A float op's output read by a quantized op and by another op - EfficientNet's and MobileNetV3's
squeeze-excite, ``x * sigmoid(fc2(relu(fc1(avgpool(x)))))`` with ``x = silu(conv(...))`` - used
to be quantized where the quantized op (the ``mul``) reads it while the pool read the float value:
no integer program could be lowered from such a model (the pool's input had no QuantizeLinear).
Quantizing the value for all readers puts the pool on the same codes as the multiply.
"""

from __future__ import annotations

import torch

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


def fan_out_readers(value: torch.fx.Node, scope: str) -> list[torch.fx.Node]:
    """The readers of ``value`` that quantize it, when ``value`` fans out to several readers and
    none reads it as a divisor (a divisor stays float, see ``_ops.DIVISOR_INPUTS``); else []."""
    users = list(value.users)
    if len(users) < 2 or any(reads_as_divisor(u, value) for u in users):
        return []
    return [u for u in users if quantizing_reader(u, value, scope)]
