"""Concats whose inputs' ranges are too far apart to share one scale.

A concat whose inputs share their output's quantizer (``Recipe.align_concat_inputs``) gives all
of them one grid. When one input spans [0, 640] (box coordinates in pixels) and another [0, 1]
(class probabilities), the step is 640 / 255 = 2.5 and every probability rounds to 0 or 2.5: one
shared scale wipes out the small-range part. Detectors end in such a concat, often as the graph
output.

``mismatched_concats`` runs the float captured graph on one batch (the first calibration batch)
and returns the concats whose largest input span (max - min) is at least ``RANGE_RATIO`` times
their smallest (inputs that depend on no graph input are left out, as placement leaves them): with 8 bits the small input would keep at most 256 / 16 = 16 levels (4 bits).
Placement then quantizes those inputs on their own scales and leaves the concat and its output
in float (``place_quantizers(separate_concats=...)``). The decision is recorded by fx node name
in ``QuantModel.qb_capture`` so that ``load`` places the same quantizers again.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from ._nodes import constant_values

RANGE_RATIO = 16.0
CONCAT_OPS = frozenset({torch.ops.aten.cat.default})


def mismatched_concats(
    gm: torch.fx.GraphModule, args: tuple, kwargs: dict, ratio: float = RANGE_RATIO
) -> dict[str, list[float]]:
    """fx name of each concat with inputs' spans ``ratio`` or more apart -> the spans."""
    cats = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in CONCAT_OPS]
    if not cats:
        return {}
    constant = constant_values(gm.graph)  # placement leaves these float: not part of the grid
    watched = {
        a for n in cats for a in n.args[0] if isinstance(a, torch.fx.Node) and a not in constant
    }
    spans: dict[torch.fx.Node, float] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node):
            out = super().run_node(n)
            if n in watched and isinstance(out, torch.Tensor) and out.is_floating_point():
                spans[n] = float(out.max() - out.min()) if out.numel() else 0.0
            return out

    with torch.no_grad():
        _Recorder(gm).run(*tree_flatten((args, kwargs))[0])
    found = {}
    for n in cats:
        measured = [spans[a] for a in n.args[0] if a in spans]
        if len(measured) >= 2 and min(measured) > 0 and max(measured) >= ratio * min(measured):
            found[n.name] = measured
    return found
