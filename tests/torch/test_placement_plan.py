"""Placement as data (issue 8): ``plan_placement`` decides without touching the graph, and one
step (``apply_plan``) applies the plan; the plan says which quantizer each value's grid is."""

from __future__ import annotations

import dataclasses

import torch

from quantbridge.recipe import resolve_recipe
from quantbridge.torch._capture import capture
from quantbridge.torch._passes import fold_batchnorm, own_parameters
from quantbridge.torch._placement import CONTAINER, plan_placement
from quantbridge.torch._record import apply_plan
from quantbridge.zoo import DigitsCNN

aten = torch.ops.aten


def _captured():
    torch.manual_seed(0)
    gm = capture(DigitsCNN().eval(), (torch.randn(2, 1, 8, 8),), {}, "batch")
    own_parameters(gm)
    fold_batchnorm(gm)
    return gm


def test_plan_changes_nothing_and_apply_follows_it():
    gm = _captured()
    code = gm.code
    recipe = dataclasses.replace(resolve_recipe("int8"), align_add_inputs=True)
    plan = plan_placement(gm, recipe)
    assert gm.code == code and not hasattr(gm, CONTAINER)  # decisions only
    kinds = [plan.specs[i].kind for i in plan.order]
    assert kinds.count("weight") == kinds.count("bias") == 5
    # the max-pool's output shares the grid of the conv2 output quantizer it reads
    (pool,) = [n for n in gm.graph.nodes if n.target is aten.max_pool2d.default]
    conv_out = plan.grid[pool.args[0]]
    assert plan.grid[pool] == conv_out and plan.specs[conv_out].point.name.startswith("conv2/")
    # the residual add's inputs were aligned: one of them now shares the other's quantizer
    assert plan.merged and all(plan.resolve(old) == new for old, new in plan.merged.items())
    merged_attrs = {plan.specs[old].point.attr for old in plan.merged}
    points = apply_plan(gm, plan)
    assert [p.name for p in points] == [plan.specs[i].point.name for i in plan.order]
    container = getattr(gm, CONTAINER)
    assert [a for a, _ in container.named_children()] == [p.attr for p in points]
    assert not merged_attrs & {p.attr for p in points}
    calls = [n for n in gm.graph.nodes if str(n.target).startswith(CONTAINER + ".")]
    assert {str(n.target).split(".", 1)[1] for n in calls} == {p.attr for p in points}
    with torch.no_grad():
        gm(torch.randn(3, 1, 8, 8))  # calibrating quantizers: the graph runs
