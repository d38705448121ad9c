"""Placement of stacked mixture-of-experts weights (``_experts`` finds them): the quantizer spec
on the parameter and the read by its index. Apart from ``_experts`` so that ``_ops`` (which asks
``_experts`` which products read such weights) does not import ``_record``."""

from __future__ import annotations

import torch

from ._experts import stacked_reads
from ._record import QuantizerSpec, parameter_point


def place_stacked_weights(planner, node: torch.fx.Node, wr) -> set:
    """Give each stacked weight ``node`` reads its weight quantizer (one per parameter, read by
    the index); return the operands so handled (they get no activation quantizer)."""
    handled = set()
    for r in stacked_reads(node):
        if r.param not in planner.weight_spec:
            point = parameter_point(r.param, "weight", wr.scheme.to_dict(), wr.method)
            spec = QuantizerSpec(
                point, "weight", wr, axis=r.out_axis, source=r.param.target, stacked=True
            )
            planner.weight_spec[r.param] = planner._spec(spec)
        planner._read(r.index, r.param, planner.weight_spec[r.param])
        handled.add(r.operand)
    return handled
