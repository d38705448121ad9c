"""The fold registry keyed by op type: ``@register_fold("Conv")`` marks the handler that turns a
quantized ``Conv`` (DequantizeLinear inputs, QuantizeLinear output) into ``QLinearConv``.

A handler is a pure function ``(GraphView, node) -> Rewrite | None``; None means "this node does
not fold" and the node stays in QDQ form.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from ._graph import GraphView, Rewrite

FoldFn = Callable[[GraphView, onnx.NodeProto], "Rewrite | None"]
_FOLDS: dict[str, FoldFn] = {}


def register_fold(*op_types: str) -> Callable[[FoldFn], FoldFn]:
    """Register the decorated handler for each of ``op_types`` (one handler per op type)."""

    def decorate(fn: FoldFn) -> FoldFn:
        for op in op_types:
            if op in _FOLDS:
                raise ValueError(f"a fold for {op!r} is registered twice ({_FOLDS[op].__name__})")
            _FOLDS[op] = fn
        return fn

    return decorate


def fold_handler(op_type: str) -> FoldFn | None:
    return _FOLDS.get(op_type)


def foldable_ops() -> list[str]:
    """The op types that have a fold handler, sorted."""
    return sorted(_FOLDS)
