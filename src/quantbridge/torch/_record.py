"""The placement record and the graph edits that put one quantizer in place.

* ``QuantPoint`` - plain data: which user module and tensor each quantizer serves (export, save
  and debug tools read the record, never guess from names or positions);
* ``output_quantizers`` - which quantizer each model output lies on (``QuantModel.qb_outputs``);
* ``add_quantizer`` / ``insert_call`` - a quantizer module under the container and its call;
* ``add_bias_quantizer`` / ``quantize_new_bias`` - the int32 bias quantizer of a weighted op, a
  plain function (placement uses it, and BN folding in QAT for a bias the fold created).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ._fakequant import BiasQuantizer, Quantizer
from ._ops import WEIGHTED_OPS

CONTAINER = "_quantbridge"


@dataclass
class QuantPoint:
    """Record of one quantizer: where it sits and what it quantizes."""

    attr: str  # attribute under the container module
    name: str  # user-facing name: '<module path>/<node>' or a parameter name
    kind: str  # 'activation' | 'weight' | 'bias'
    module: str  # user module path the quantized tensor comes from ('' = top level)
    tensor: str  # fx node name of the quantized value (first call site)
    scheme: dict  # QScheme.to_dict()
    method: str

    def to_dict(self) -> dict:
        return asdict(self)


def parameter_point(param: torch.fx.Node, kind: str, scheme: dict, method: str) -> QuantPoint:
    """Record of a quantizer on a parameter (a get_attr node), named by the parameter."""
    module = param.target.rpartition(".")[0]
    return QuantPoint("", param.target, kind, module, param.name, scheme, method)


def output_quantizers(gm: torch.fx.GraphModule) -> list[str | None]:
    """Per output of ``gm`` (in the flattened order of its return value), the container attribute
    of the quantizer whose grid that output lies on, or None for a float output. Recorded once
    placement is done (``QuantModel.qb_outputs``), so nobody has to guess "the output quantizer"
    by list position."""
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    leaves = torch.utils._pytree.tree_leaves(out.args[0])
    attrs: list[str | None] = []
    prefix = CONTAINER + "."
    for leaf in leaves:
        is_quantizer = (
            isinstance(leaf, torch.fx.Node)
            and leaf.op == "call_module"
            and str(leaf.target).startswith(prefix)
        )
        attrs.append(str(leaf.target)[len(prefix) :] if is_quantizer else None)
    return attrs


def add_quantizer(container: nn.Module, module: nn.Module, point: QuantPoint) -> str:
    """Add ``module`` to the quantizer container under an attribute derived from the point's
    name (made unique); sets ``point.attr`` and returns the call target."""
    base = re.sub(r"\W", "_", point.name).strip("_") or "q"
    attr, i = base, 1
    while hasattr(container, attr):
        i += 1
        attr = f"{base}_{i}"
    container.add_module(attr, module)
    point.attr = attr
    return f"{CONTAINER}.{attr}"


def insert_call(
    graph: torch.fx.Graph, target: str, value: torch.fx.Node, observe: bool = True
) -> torch.fx.Node:
    """A call of quantizer ``target`` on ``value``, right after it (uses not rewired)."""
    with graph.inserting_after(value):
        kwargs = {} if observe else {"observe": False}
        node = graph.call_module(target, (value,), kwargs)
    node.meta["val"] = value.meta.get("val")
    node.meta["nn_module_stack"] = value.meta.get("nn_module_stack", {})
    return node


def add_bias_quantizer(
    gm: torch.fx.GraphModule, node: torch.fx.Node, input_quantizer: Quantizer | None
) -> tuple[BiasQuantizer, QuantPoint] | None:
    """Quantize the bias of WEIGHTED op ``node`` to int32: a ``BiasQuantizer`` from the op's input
    quantizer and its weight quantizer, inserted on the bias. None (nothing changed) when the op
    has no parameter bias, its input is not quantized or its weight has no quantizer."""
    i_x, i_w, i_b, _ = WEIGHTED_OPS[node.target]
    b = node.args[i_b] if len(node.args) > i_b else None
    w_node = node.args[i_w]
    if not (isinstance(b, torch.fx.Node) and b.op == "get_attr") or input_quantizer is None:
        return None
    if not (w_node.op == "call_module" and w_node.target.startswith(CONTAINER + ".")):
        return None
    bq = BiasQuantizer(b.target, input_quantizer, gm.get_submodule(w_node.target))
    bq.bias_name = b.target
    point = parameter_point(b, "bias", {"bits": 32, "signed": True}, "derived")
    target = add_quantizer(getattr(gm, CONTAINER), bq, point)
    node.replace_input_with(b, insert_call(gm.graph, target, b))
    return bq, point


def quantize_new_bias(
    gm: torch.fx.GraphModule, node: torch.fx.Node, recipe: object = None
) -> QuantPoint | None:
    """Give a WEIGHTED op a bias quantizer after the fact (a bias created by BN folding); the
    point placed, or None. ``recipe`` is unused (the int32 bias scheme is fixed)."""
    x = node.args[WEIGHTED_OPS[node.target][0]]
    is_quantizer = (
        isinstance(x, torch.fx.Node)
        and x.op == "call_module"
        and str(x.target).startswith(CONTAINER + ".")
    )
    placed = add_bias_quantizer(gm, node, gm.get_submodule(x.target) if is_quantizer else None)
    if placed is None:
        return None
    gm.graph.lint()
    gm.recompile()
    return placed[1]
