"""The rows of ``sensitivity`` for quantizers outside every module: one per op of the model's own
``forward`` (a global-average-pool ``mean``, a squeeze-excitation ``mul``, a residual ``add``),
named after its graph node, instead of one row named ``""`` that lumped them together.

A weight or bias quantizer at the top level (a parameter of the model itself, an imported
file's constant that no layer owns) goes with the op that reads it. The rows cannot be repaired
one by one: recipe rules match module paths, and ``Rule(pattern="")`` matches every top-level op
at once (``NOTE``).
"""

from __future__ import annotations

import torch

from ..torch import QuantModel
from ..torch._nodes import module_of
from ..torch._placement import CONTAINER

TOP_LEVEL = ""  # QuantPoint.module of a quantizer outside every module
NOTE = (
    "top-level op (no module): no rule names it alone; Rule(pattern='', skip=True) keeps every "
    "top-level op float, or move it into a module"
)


def top_level_rows(qmodel: QuantModel, modules: set[str]) -> dict[str, tuple[str, str]]:
    """Quantizer attribute -> (row name, op) for the top-level quantizers of ``qmodel``. The row
    name is the op's node (``mean_1``), with `` (top level)`` added where a module of that path
    exists (``modules``)."""
    nodes = {n.name: n for n in qmodel.graph.nodes}
    prefix = CONTAINER + "."
    rows = {}
    for point in qmodel.qb_points:
        if point.module != TOP_LEVEL:
            continue
        node = nodes.get(point.tensor)
        if point.kind != "activation" and node is not None:
            node = _reader(node, prefix) or node
        name = node.name if node is not None else point.name
        rows[point.attr] = (f"{name} (top level)" if name in modules else name, _op(node))
    return rows


def _reader(param: torch.fx.Node, prefix: str) -> torch.fx.Node | None:
    """The op reading a parameter, through its quantizer call."""
    for user in param.users:
        if user.op == "call_module" and str(user.target).startswith(prefix):
            return next(iter(user.users), None)
        if user.op == "call_function" and module_of(user)[0] == TOP_LEVEL:
            return user
    return None


def _op(node: torch.fx.Node | None) -> str:
    if node is None or node.op == "get_attr":
        return "parameter"
    target = getattr(node.target, "__name__", str(node.target))
    return target.split(".")[0]
