"""The layers of a ``QuantModel`` whose weights run in float, and why: read from its graph, so a
loaded checkpoint answers as the model it was saved from.

A weight is quantized when a quantizer of the model (a ``call_module`` under ``CONTAINER``) stands
between its parameter and the op reading it; any other float parameter or buffer of two or more
dimensions that a product reads (a conv, a linear, ``addmm``, a matmul / einsum of a parameter,
a recurrent layer), directly or through views, is a float weight. So is one that an op of
another library reads (``unknown_readers``: Hugging Face mixture-of-experts run their experts
through ``transformers.grouped_mm_fallback`` by default, and aten's ``_grouped_mm`` /
``addbmm`` / ``mv`` are in none of the op tables): before, those weights stayed float without a
word. Why: a recipe rule that skips the layer (kept float on purpose: the rule is named), or
placement's reason (``_ops``: no int8 form), which placement also warns about.
``QuantModel.summary`` lists them, so that no layer is float without a word.
"""

from __future__ import annotations

import torch

from ..recipe import Recipe
from ._nodes import module_of
from ._ops import (
    _CONSTANT_PRODUCT_OPS,
    _VIEWS,
    _WEIGHTED_OVERLOADS,
    WEIGHTED_OPS,
    unquantized_weighted_reason,
)
from ._record import CONTAINER

aten = torch.ops.aten
# products of aten no op table knows (their weights stay float)
_UNTABLED_PRODUCTS = frozenset(
    getattr(aten, op).default
    for op in ("_grouped_mm", "addbmm", "addmv", "mv")
    if hasattr(aten, op)
)
# ops reading a weight: every tensor argument is looked at (recurrent layers take a list)
_READERS = _WEIGHTED_OVERLOADS | _CONSTANT_PRODUCT_OPS | _UNTABLED_PRODUCTS
# namespaces of ops that are not another library's: torch's own (elementwise ops, lookups and
# norms read parameters without a product) and higher-order wrappers
_OWN_NAMESPACES = frozenset({"aten", "prims", "higher_order", "_operator"})


def _float_weight(gm: torch.nn.Module, node) -> str | None:
    """The target of the float parameter / buffer ``node`` reads through views, unquantized;
    None when a quantizer stands between them or ``node`` reads no such tensor."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        prefix, _, attr = str(node.target).rpartition(".")
        value = getattr(gm.get_submodule(prefix) if prefix else gm, attr, None)
    ok = isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2
    return str(node.target) if ok and not str(node.target).startswith(CONTAINER) else None


def _operands(node: torch.fx.Node) -> list:
    if node.target in WEIGHTED_OPS:
        position = WEIGHTED_OPS[node.target][1]
        return [node.args[position]] if len(node.args) > position else []
    flat = []
    for a in node.args:
        flat.extend(a if isinstance(a, (list, tuple)) else [a])
    return flat


def _skipping_rule(recipe: Recipe | None, module: str, module_type: str) -> str | None:
    if recipe is None or not recipe.for_module(module, module_type)[0]:
        return None
    rule = [r for r in recipe.rules if r.matches(module, module_type) and r.skip][-1]
    return f"kept float by the recipe rule {rule.describe()[:-1]}, skip=True)"


def _other_library(node: torch.fx.Node) -> bool:
    namespace = getattr(node.target, "namespace", None)
    return isinstance(namespace, str) and namespace not in _OWN_NAMESPACES


def _untabled_reason(node: torch.fx.Node, weights: list[str]) -> str:
    op = getattr(node.target, "_name", None) or str(node.target)
    return (
        f"{op} reads the parameter {', '.join(weights)}: an op in none of quantbridge's op "
        "tables, so its weights stay float"
    )


def unknown_readers(gm: torch.fx.GraphModule) -> list[tuple[str, str, str]]:
    """(layer, its class name, reason) of each layer whose ops of another library or untabled
    aten products read unquantized float parameters (one entry per layer, every such parameter
    named): placement's warning names them."""
    found: dict[str, tuple[str, torch.fx.Node, list[str]]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and (
            _other_library(node) or node.target in _UNTABLED_PRODUCTS
        ):
            weights = [w for w in (_float_weight(gm, a) for a in _operands(node)) if w]
            if weights:
                module, module_type = module_of(node)
                entry = found.setdefault(module or node.name, (module_type, node, []))
                entry[2].extend(w for w in weights if w not in entry[2])
    return [(name, t, _untabled_reason(node, ws)) for name, (t, node, ws) in found.items()]


def float_layers(gm: torch.fx.GraphModule, recipe: Recipe | None) -> dict[str, str]:
    """Layer (module path, or the node's name) -> why its weight runs in float."""
    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not (node.target in _READERS or _other_library(node)):
            continue
        weights = [w for w in (_float_weight(gm, a) for a in _operands(node)) if w]
        if not weights:
            continue
        module, module_type = module_of(node)
        why = _skipping_rule(recipe, module, module_type) or unquantized_weighted_reason(node)
        if why is None and (_other_library(node) or node.target in _UNTABLED_PRODUCTS):
            why = _untabled_reason(node, weights)
        found.setdefault(module or node.name, why or f"its weight {weights[0]} is not quantized")
    return found
