"""Graph helpers the PTQ methods share: read and replace the weight and bias of a captured
conv / linear node, and run the captured graph recording chosen nodes' values."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .._ops import TRANSPOSED_CONV_OPS, WEIGHTED_OPS
from .._passes import _owner, _unwrap

aten = torch.ops.aten

# weighted ops the methods rescale: weight (out, in / groups, ...), output channels on axis 0
PLAIN_WEIGHTED = frozenset(op for op in WEIGHTED_OPS if op not in TRANSPOSED_CONV_OPS)
CONV_OPS = frozenset(PLAIN_WEIGHTED - {aten.linear.default})


def attr_node(node) -> torch.fx.Node | None:
    """The ``get_attr`` node behind an argument (through placed quantizers), else None."""
    node = _unwrap(node)
    return node if isinstance(node, torch.fx.Node) and node.op == "get_attr" else None


def get_tensor(gm: nn.Module, node: torch.fx.Node) -> torch.Tensor:
    owner, attr = _owner(gm, node.target)
    return getattr(owner, attr)


def set_tensor(gm: nn.Module, node: torch.fx.Node, value: torch.Tensor) -> None:
    """Replace the parameter (or buffer) read by ``node`` with ``value`` in its dtype."""
    owner, attr = _owner(gm, node.target)
    old = getattr(owner, attr)
    value = value.detach().to(old.dtype)
    if isinstance(old, nn.Parameter):
        setattr(owner, attr, nn.Parameter(value, requires_grad=old.requires_grad))
    else:
        owner.register_buffer(attr, value)


def weight_and_bias(gm: nn.Module, node: torch.fx.Node):
    """(weight get_attr, bias get_attr or None) of a conv / linear, or None when the weight is
    not a plain parameter of the captured module."""
    if node.op != "call_function" or node.target not in PLAIN_WEIGHTED:
        return None
    w = attr_node(node.args[1])
    if w is None:
        return None
    b = attr_node(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else None
    if len(node.args) > 2 and node.args[2] is not None and b is None:
        return None
    return w, b


def conv_geometry(node: torch.fx.Node, dims: int) -> tuple[tuple[int, ...], ...]:
    """(stride, padding, dilation) of an ``aten.conv*d`` node, ``dims`` ints each (aten's
    defaults 1, 0, 1 where an argument is absent; a one-element list broadcasts)."""
    args = list(node.args) + [None] * 7
    return tuple(_per_dim(v, d, dims) for v, d in zip(args[3:6], (1, 0, 1), strict=True))


def _per_dim(value, default: int, dims: int) -> tuple[int, ...]:
    if value is None:
        return (default,) * dims
    value = list(value) if isinstance(value, (list, tuple)) else [value]
    return tuple(int(v) for v in (value * dims if len(value) == 1 else value))


def groups_of(node: torch.fx.Node) -> int:
    if node.target in CONV_OPS:
        return int(node.args[6]) if len(node.args) > 6 else int(node.kwargs.get("groups", 1))
    return 1


def record(
    gm: torch.fx.GraphModule,
    batches: Iterable[tuple[tuple, dict]],
    watched: set[torch.fx.Node],
    on_value: Callable[[torch.fx.Node, torch.Tensor], None],
    on_args: Callable[[torch.fx.Node, tuple], None] | None = None,
    stop_after: torch.fx.Node | None = None,
) -> None:
    """Run every batch through ``gm``; ``on_value(node, value)`` for each watched node's output,
    ``on_args(node, args)`` with its evaluated arguments. ``stop_after``: skip the rest of the
    graph once that node ran."""

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node):
            if n in watched and on_args is not None:
                args, _ = self.fetch_args_kwargs_from_env(n)
                on_args(n, args)
            out = super().run_node(n)
            if n in watched:
                on_value(n, out)
            if n is stop_after:
                raise _Stop
            return out

    with torch.no_grad():
        for args, kwargs in batches:
            try:
                _Recorder(gm).run(*tree_flatten((args, kwargs))[0])
            except _Stop:
                pass


class _Stop(Exception):
    pass
