"""Whether torch's ONNX type-promotion pass would change a program's graph at all.

The export fast path (``_torch_onnx._fast``) runs torch's ``insert_type_promotion_nodes`` before
translating: an ``fx.Interpreter`` that re-runs every node of the graph on fake tensors (under the
python dispatcher) only to learn the dtypes of the arguments of the ops that have a promotion
rule, and inserts a cast where an argument's dtype is not the one the rule promotes to. On a
graph whose arguments already have those dtypes (every float32 CNN and transformer we export:
the quantizers' custom ops are not in the table) it inserts nothing and leaves every node as it
was: 0.60 of the 2.51 CPU seconds of a default-quantized ResNet-18-style export (224x224, fresh
process, 1 thread; the whole quantize + export 8.32 -> 7.68 CPU s with this skip, same file).

``promotion_needed`` makes the pass's own decision from the dtypes the capture already recorded
(``node.meta["val"]``: the same fake values the pass would recompute, since a graph it leaves
unchanged re-runs each op on the same dtypes), with the pass's own rule table and
``preview_type_promotion``; it answers True (run the pass) wherever it cannot tell: a missing
value, an argument form the pass itself does not handle, a nested graph module, any error.
The exported files are the same byte for byte (``tests/onnx/test_type_promotion_skip.py``).
"""

from __future__ import annotations

from typing import Any

import torch


def promotion_needed(graph_module: torch.fx.GraphModule) -> bool:
    """False only when torch's ``InsertTypePromotion`` would leave ``graph_module`` unchanged."""
    try:
        from torch.onnx._internal.fx import type_utils
        from torch.onnx._internal.fx.passes import type_promotion as tp
    except ImportError:  # another torch: its internals moved
        return True
    try:
        if any(m is not graph_module for m in graph_module.modules()):
            return True  # nested graphs (control flow): the pass recurses into them
        table = tp.TypePromotionTable()
        for node in graph_module.graph.nodes:
            if node.op != "call_function":
                continue
            rule = tp.get_type_promotion_rule(node, table)
            if rule is None:
                continue
            args = torch.fx.map_arg(node.args, _value)
            kwargs = torch.fx.map_arg(node.kwargs, _value)
            info = rule.preview_type_promotion(args, kwargs)
            wanted = [(info.args_dtypes.get(i), a) for i, a in enumerate(node.args)]
            wanted += [(info.kwargs_dtypes.get(k), a) for k, a in node.kwargs.items()]
            if any(_changes(arg, dtype, type_utils) for dtype, arg in wanted):
                return True
        return False
    except Exception:  # the pass decides wherever this reading cannot
        return True


class _Unknown(Exception):
    pass


def _value(node: torch.fx.Node) -> Any:
    if "val" not in node.meta:
        raise _Unknown(node.name)
    return node.meta["val"]


def _changes(arg: Any, dtype: torch.dtype | None, type_utils: Any) -> bool:
    """Whether the pass's ``_maybe_promote_arg`` would replace ``arg`` (True where it would
    raise: then the pass must run for the fast path to fail as before)."""
    if dtype is None:
        return False
    if isinstance(arg, torch.fx.Node):
        val = _value(arg)
        if isinstance(val, torch.Tensor):
            return val.dtype != dtype
        if type_utils.is_torch_symbolic_type(val):
            return type_utils.from_scalar_type_to_torch_dtype(type(val)) != dtype
        return True
    scalar = type_utils.from_scalar_type_to_torch_dtype(type(arg))
    if scalar is not None:
        return scalar != dtype
    if isinstance(arg, (tuple, list)):
        return any(_changes(a, dtype, type_utils) for a in arg)
    return True
