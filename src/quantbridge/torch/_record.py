"""The placement record and the graph edits that put one quantizer in place.

* ``QuantPoint`` - plain data: which user module and tensor each quantizer serves (export, save
  and debug tools read the record, never guess from names or positions);
* ``output_quantizers`` - which quantizer each model output lies on (``QuantModel.qb_outputs``);
* ``PlacementPlan`` - what placement decided, as data (quantizers to create, which quantizer
  each value shares, the graph edits in order), and ``apply_plan``, the one step that applies it;
* ``add_quantizer`` / ``insert_call`` - a quantizer module under the container and its call;
* ``add_bias_quantizer`` / ``quantize_new_bias`` - the int32 bias quantizer of a weighted op, a
  plain function (placement uses it, and BN folding in QAT for a bias the fold created).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..recipe import TensorRecipe
from ._fakequant import (
    BiasQuantizer,
    ConstantQuantizer,
    Quantizer,
    StackedWeightQuantizer,
    WeightQuantizer,
)
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


@dataclass
class QuantizerSpec:
    """One quantizer to create: its record, kind and recipe; a weight's axis and parameter, a
    bias's parameter and the specs of its input and weight quantizers, a constant's value (a
    Python scalar) or buffer."""

    point: QuantPoint
    kind: str  # 'activation' | 'weight' | 'bias' | 'constant'
    recipe: TensorRecipe | None
    axis: int | None = None
    source: str = ""  # the parameter or buffer quantized (weight, bias, buffer constant)
    value: float | None = None  # a scalar constant
    bias_of: tuple[int, int] | None = None  # (input spec, weight spec)
    stacked: bool = False  # a weight [E, O, K] of stacked experts, ``axis`` = O (``_experts``)


@dataclass
class Edit:
    """One graph edit: a call of quantizer ``spec`` on ``value`` that

    * ``consumer``: ``consumer`` reads (one call per value and quantizer, shared by consumers);
    * ``all``: every use reads (with ``observe=False`` for a value sharing another's grid);
    * ``arg``: replaces argument ``index`` of ``consumer`` (a buffer constant);
    * ``scalar``: replaces the scalar argument ``index`` of ``consumer`` (``value`` is None);
    * ``requantize``: ``consumer`` reads ``value``, already quantized on its own grid, through
      quantizer ``spec`` too (a concat input kept off the concat's shared grid);
    * ``create``: creates quantizer ``spec``; ``merge``: ``spec`` shares quantizer ``index``.
    """

    kind: str
    spec: int
    value: torch.fx.Node | None
    consumer: torch.fx.Node | None = None
    index: int | None = None
    observe: bool = True


@dataclass
class PlacementPlan:
    """What placement decided, before anything is inserted."""

    specs: list[QuantizerSpec] = field(default_factory=list)
    edits: list[Edit] = field(default_factory=list)
    # value -> spec whose grid every consumer reads it on; (consumer, value) -> spec for one
    grid: dict[torch.fx.Node, int] = field(default_factory=dict)
    reads: dict[tuple[torch.fx.Node, torch.fx.Node], int] = field(default_factory=dict)
    merged: dict[int, int] = field(default_factory=dict)  # spec -> the spec it shares
    order: list[int] = field(default_factory=list)  # the specs of the record, in its order

    def resolve(self, spec: int) -> int:
        while spec in self.merged:
            spec = self.merged[spec]
        return spec

    def target(self, spec: int) -> str:
        return f"{CONTAINER}.{self.specs[spec].point.attr}"


def apply_plan(gm: torch.fx.GraphModule, plan: PlacementPlan) -> list[QuantPoint]:
    """Make the plan's edits in order under ``gm._quantbridge``: create each quantizer, insert its
    calls, and on a merge move the merged quantizer's calls (and the bias scales taken from it)
    to the one it shares, then remove it. Returns the placement record."""
    container = nn.Module()
    gm.add_submodule(CONTAINER, container)
    modules: dict[int, nn.Module] = {}
    calls: dict[tuple[int, torch.fx.Node], torch.fx.Node] = {}
    quantized: dict[torch.fx.Node, torch.fx.Node] = {}  # value -> its "all" quantizer call
    for e in plan.edits:
        if e.kind == "create":
            modules[e.spec] = _build(gm, plan, e.spec, modules)
            container.add_module(plan.specs[e.spec].point.attr, modules[e.spec])
            continue
        if e.kind == "merge":
            _merge(gm, container, modules, e.spec, e.index)
            continue
        target = _target_of(container, modules[e.spec])
        if e.kind == "requantize":
            src = quantized.get(e.value, e.value)
            e.consumer.replace_input_with(src, insert_call(gm.graph, target, src))
            continue
        if e.kind == "scalar":
            fq = _scalar_call(gm.graph, target, modules[e.spec], e.consumer)
        elif e.kind == "all":
            fq = quantized[e.value] = insert_call(gm.graph, target, e.value, e.observe)
            e.value.replace_all_uses_with(fq, delete_user_cb=lambda u, fq=fq: u is not fq)
        else:
            fq = calls.get((e.spec, e.value))
            if fq is None:
                fq = calls[(e.spec, e.value)] = insert_call(gm.graph, target, e.value)
            if e.kind == "consumer":
                e.consumer.replace_input_with(e.value, fq)
        if e.kind in ("scalar", "arg"):
            args = list(e.consumer.args)
            args[e.index] = fq
            e.consumer.args = tuple(args)
    gm.graph.lint()
    gm.recompile()
    return [plan.specs[i].point for i in plan.order]


def _target_of(container: nn.Module, module: nn.Module) -> str:
    return next(f"{CONTAINER}.{a}" for a, m in container.named_children() if m is module)


def _merge(gm, container: nn.Module, modules: dict[int, nn.Module], old: int, new: int) -> None:
    old_q, new_q = modules.pop(old), modules[new]
    new_target = _target_of(container, new_q)
    for n in gm.graph.nodes:
        if n.op == "call_module" and str(n.target).startswith(CONTAINER + "."):
            if gm.get_submodule(n.target) is old_q:
                n.target = new_target
    for m in modules.values():
        if isinstance(m, BiasQuantizer) and m.input_quantizer is old_q:
            m.use_input_quantizer(new_q)
    delattr(container, next(a for a, m in container.named_children() if m is old_q))
    modules[old] = new_q  # later edits recorded before the merge reach the shared quantizer


def _build(gm, plan: PlacementPlan, i: int, modules: dict[int, nn.Module]) -> nn.Module:
    spec = plan.specs[i]
    if spec.kind == "activation":
        return Quantizer(spec.point.name, spec.recipe, "activation")
    if spec.kind == "weight":
        kind = StackedWeightQuantizer if spec.stacked else WeightQuantizer
        wq = kind(spec.source, spec.recipe, spec.axis)
        wq.weight_name = spec.source
        return wq
    if spec.kind == "bias":
        x_spec, w_spec = spec.bias_of
        bq = BiasQuantizer(spec.source, modules[x_spec], modules[w_spec])
        bq.bias_name = spec.source
        return bq
    if spec.value is not None:  # a Python scalar: the module holds it
        value = torch.tensor(spec.value, dtype=torch.float32)
        q = ConstantQuantizer(spec.point.name, spec.recipe, value, own=True)
        q.constant_name = f"{plan.target(i)}.value"
        return q
    q = ConstantQuantizer(spec.source, spec.recipe, gm.get_buffer(spec.source))
    q.constant_name = spec.source
    return q


def _scalar_call(graph, target: str, q: ConstantQuantizer, consumer: torch.fx.Node):
    with graph.inserting_before(consumer):
        value = graph.get_attr(q.constant_name)
        value.meta["val"] = q.value
        fq = graph.call_module(target, (value,))
    fq.meta["val"] = q.value
    fq.meta["nn_module_stack"] = consumer.meta.get("nn_module_stack", {})
    return fq


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
    attr = unique_attr(container, point.name)
    container.add_module(attr, module)
    point.attr = attr
    return f"{CONTAINER}.{attr}"


def unique_attr(container: nn.Module, name: str) -> str:
    """An attribute name for a quantizer named ``name``, free on ``container``."""
    base = re.sub(r"\W", "_", name).strip("_") or "q"
    attr, i = base, 1
    while hasattr(container, attr):
        i += 1
        attr = f"{base}_{i}"
    return attr


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
