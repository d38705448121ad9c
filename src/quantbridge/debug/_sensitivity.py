"""``sensitivity``: which layers cost the most accuracy when quantized, and the smallest recipe
change that meets a budget.

A *layer* is a user module path (the innermost module a quantized op runs in, the unit recipe
rules match on; each arithmetic node of an imported ONNX file is a layer named after the node,
``importer/_module.OnnxOp``; an op of the model's own ``forward`` is a row named after its graph
node, which no rule can repair alone, ``_sens_top``). The model is quantized
once with the base recipe; each layer's quantizers (its weights, biases, and the activations its
ops produce) are then switched off and on (``Quantizer.enabled``) to measure, on the evaluation set, against
the user's float model (``float_reference``: not the QuantModel with every quantizer off, whose
biases bias correction has shifted):

* ``only_this_quantized``: the metric with this layer's quantizers on and every other layer's off;
* ``all_but_this_quantized``: the metric with every layer quantized except this one.

Quantizers of graph inputs belong to no layer and stay as the recipe places them. Layers are
ranked by ``all_but_this_quantized`` (highest first: keeping that layer float recovers most),
then by ``only_this_quantized`` (lowest first).

A layer whose own ops all run float (a LayerNorm: placement quantizes no op of it, and its
quantizers are its output where the layers reading it quantize that) cannot be repaired by a rule
naming it: the rule matches nothing. Such layers are listed after the repairable ones with
``repairable=False`` and a ``note`` naming the layers to repair instead (its readers), and the
repair search leaves them out.

Repair (with a ``budget``, a lower bound on the metric): ``_sens_search`` finds a set of layers
to keep float on the switched-off estimate (families of repeated-block layers or the next layer
in rank order, forward; then each layer dropped again where the estimate allows); the set is then
*verified* by quantizing the model again with the written recipe (``Rule(pattern=<layer>,
skip=True)``, or int16 activations with ``wider="int16"``) and measuring it. While the verified
metric misses the budget, the next ranked layer is added and verified again. Once it meets the
budget, each kept layer (least sensitive first) is put back to int8 where the verified metric
still meets it (one re-quantization per layer tried). Growing and pruning together re-quantize
the model at most ``max_verify`` times; pruning stops when they are spent (the layers not tried
stay float). The result reports the verified (``achieved``) metric and the re-quantizations it
took (``verified``); ``recipe`` is that recipe.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn
from tqdm.auto import tqdm

from ..recipe import Recipe, Rule, TensorRecipe
from ..torch import QuantModel, float_mode
from ..torch._nodes import module_of
from ..torch._ops import Role, op_role
from ..torch._progress import progress_enabled, stage
from ..torch._record import CONTAINER
from ._sens_metrics import Outputs, check_budget, metric_fn
from ._sens_model import Subject, from_onnx, from_torch, is_onnx
from ._sens_search import estimate_search, prune
from ._sens_top import NOTE as TOP_LEVEL_NOTE
from ._sens_top import TOP_LEVEL, top_level_rows

SCHEMA = "quantbridge.sensitivity/1"
WIDER = ("int16",)
INPUT_LAYER = "input"  # QuantPoint.module of graph-input quantizers


@dataclass
class LayerSensitivity:
    name: str
    op: str
    only_this_quantized: float
    all_but_this_quantized: float
    rank: int = 0
    repairable: bool = True
    note: str = ""  # why a layer cannot be repaired, and what to repair instead


@dataclass
class SensitivityResult:
    """The ranked layers and the repair. ``to_json()`` gives the dict of the JSON contract."""

    metric: str
    baseline: dict[str, float]  # {"float": ..., "quantized": ...}
    layers: list[LayerSensitivity]
    budget: float | None = None
    keep_float: list[str] = field(default_factory=list)
    wider: dict[str, str] = field(default_factory=dict)
    achieved: float | None = None
    recipe: Recipe | None = None
    model: str = ""
    verified: int = 0  # re-quantizations the repair ran (at most ``max_verify``)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "metric": self.metric,
            "baseline": {k: _finite(v) for k, v in self.baseline.items()},
            "layers": [
                {
                    "name": s.name,
                    "op": s.op,
                    "only_this_quantized": _finite(s.only_this_quantized),
                    "all_but_this_quantized": _finite(s.all_but_this_quantized),
                    "rank": s.rank,
                    "repairable": s.repairable,
                    "note": s.note,
                }
                for s in self.layers
            ],
            "budget": self.budget,
            "keep_float": list(self.keep_float),
            "wider": dict(self.wider),
            "achieved": _finite(self.achieved),
            "verified": self.verified,
            "recipe": self.recipe.to_dict() if self.recipe is not None else None,
        }

    def recipe_yaml(self) -> str:
        """The recipe as YAML (``qb.quantize(..., recipe=Recipe.from_yaml(text))``,
        ``quantbridge quantize --recipe FILE.yaml``), with a comment on what it achieved."""
        if self.recipe is None:
            raise ValueError("this sensitivity result has no recipe")
        head = f"# quantbridge sensitivity: {self.metric}"
        if self.budget is not None:
            head += f" budget {self.budget}, achieved {_fmt(self.achieved)}"
        head += f" (all quantized: {_fmt(self.baseline['quantized'])})\n"
        return head + self.recipe.to_yaml()

    def write_recipe(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.recipe_yaml())

    def worst(self, n: int = 10) -> list[LayerSensitivity]:
        return sorted(self.layers, key=lambda s: s.rank)[:n]


def sensitivity(
    model: nn.Module | str | os.PathLike,
    calib_data: Iterable | str | os.PathLike | dict,
    eval_data: Iterable | str | os.PathLike | dict,
    *,
    recipe: Recipe | str | dict | os.PathLike = "native",
    metric: str = "cosine",
    budget: float | None = None,
    wider: str | None = None,
    labels=None,
    batch_size: int | None = None,
    float_head: bool = True,
    dynamic: str = "batch",
    max_verify: int = 4,
    progress: bool | None = None,
) -> SensitivityResult:
    """Per-layer sensitivity of ``model`` (a torch module, or an ONNX file / ``ModelProto``) to
    quantization under ``recipe``, ranked, and with a ``budget`` the recipe that meets it (see
    the module docstring). ``metric``: ``sqnr`` (dB), ``cosine`` or ``top1`` against the float
    model (``top1`` against ``labels`` when given; for an ONNX file, an array ``labels`` in the
    evaluation npz). ``wider="int16"`` repairs with int16 activations instead of float layers."""
    score_fn = metric_fn(metric)
    if wider is not None and wider not in WIDER:
        raise ValueError(f"wider={wider!r} is unknown; use None (keep float) or one of {WIDER}")
    if budget is not None and not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be a number (a lower bound on {metric}), got {budget!r}")
    if budget is not None:
        check_budget(metric, budget)
    if isinstance(model, QuantModel) and budget is not None:
        raise ValueError(
            "a QuantModel can be ranked but not repaired (the repair quantizes again); pass the "
            "float model and its calibration data for a budget"
        )
    if is_onnx(model):
        subject = from_onnx(model, calib_data, eval_data, recipe, batch_size, float_head)
    elif isinstance(model, nn.Module):
        subject = from_torch(model, calib_data, eval_data, labels, recipe, dynamic)
    else:
        raise TypeError(
            f"sensitivity takes a torch nn.Module or an .onnx file, got {type(model).__name__}"
        )
    need_logits = metric == "top1"
    qmodel = subject.quantize(subject.recipe, progress)
    groups = layer_groups(qmodel)
    top = dict(top_level_rows(qmodel, {p.module for p in qmodel.qb_points}).values())
    if not groups:
        raise ValueError(f"{subject.name}: the recipe quantizes no layer; nothing to rank")
    ref = subject.run(float_reference(subject.module, qmodel), need_logits)

    def score(out: Outputs) -> float:
        return score_fn(ref, out, subject.labels)

    enabled = {q: q.enabled for quantizers in groups.values() for q in quantizers}

    def measure(off: Iterable[str]) -> float:
        off = set(off)
        for layer, quantizers in groups.items():
            for q in quantizers:
                q.enabled = enabled[q] and layer not in off
        try:
            return score(subject.run(qmodel, need_logits))
        finally:
            for q, was in enabled.items():
                q.enabled = was

    baseline = {"float": score(ref), "quantized": measure(())}
    layers = []
    with stage(f"sensitivity: {2 * len(groups)} runs over {len(groups)} layers", progress):
        for layer in _bar(list(groups), progress):
            others = [g for g in groups if g != layer]
            layers.append(
                LayerSensitivity(
                    layer, top.get(layer) or subject.op_of(layer), measure(others), measure([layer])
                )
            )
    _mark_unrepairable(qmodel, layers, set(top))
    ranked = [s.name for s in sorted(layers, key=lambda s: s.rank) if s.repairable]
    result = SensitivityResult(
        metric, baseline, layers, budget, recipe=subject.recipe, model=subject.name
    )
    if budget is not None:
        _repair(result, subject, qmodel, ranked, measure, score, wider, max_verify, progress)
    return result


def float_reference(module: nn.Module, qmodel: QuantModel) -> nn.Module:
    """The model the metric is measured against: the user's float model. Not ``float_mode`` of
    the QuantModel: that keeps what quantization changed in the float parameters (bias
    correction's shifted biases, AdaRound's rounded weights), which is not the float function
    (on PP-OCRv4 det, 19.2 dB away from it). A QuantModel given as it is is measured against the
    model it was quantized from where it still holds it (``qb.quantize``'s result does), else,
    loaded from a checkpoint, against its own float mode."""
    source = module.__dict__.get("_qb_source") if isinstance(module, QuantModel) else module
    if source is None or isinstance(source, QuantModel):
        return _FloatMode(qmodel)
    return source


class _FloatMode(nn.Module):
    """``qmodel`` called with every quantizer off."""

    def __init__(self, qmodel: QuantModel):
        super().__init__()
        self.qmodel = qmodel

    def forward(self, *args, **kwargs):
        with float_mode(self.qmodel):
            return self.qmodel(*args, **kwargs)


def layer_groups(qmodel: QuantModel) -> dict[str, list[nn.Module]]:
    """Layer (module path, or a top-level op's node: ``_sens_top``) -> its quantizer modules, in
    placement (topological) order."""
    container = getattr(qmodel, CONTAINER)
    top = top_level_rows(qmodel, {p.module for p in qmodel.qb_points})
    groups: dict[str, list[nn.Module]] = {}
    for point in qmodel.qb_points:
        if point.module == INPUT_LAYER:
            continue
        name = top[point.attr][0] if point.attr in top else point.module
        groups.setdefault(name, []).append(getattr(container, point.attr))
    return groups


def rank(layers: list[LayerSensitivity]) -> list[str]:
    """Set ``rank`` (1 = most sensitive, repairable layers first) on each layer; the layer names
    in rank order."""
    order = sorted(
        layers,
        key=lambda s: (
            not s.repairable,
            -_key(s.all_but_this_quantized),
            _key(s.only_this_quantized),
        ),
    )
    for i, s in enumerate(order, start=1):
        s.rank = i
    return [s.name for s in order]


def repairable_layers(qmodel: QuantModel) -> set[str]:
    """The layers a recipe rule naming them changes: those running an op placement quantizes
    (``_ops.op_role`` not float), as placement matches rules on those ops' modules only."""
    skipped = (Role.FLOAT, Role.FOLDABLE_ACTIVATION)
    return {
        module_of(n)[0]
        for n in qmodel.graph.nodes
        if n.op == "call_function" and op_role(n) not in skipped
    }


def _mark_unrepairable(qmodel: QuantModel, layers: list[LayerSensitivity], top: set[str]) -> None:
    """Mark the layers no rule can repair (``repairable_layers``; the top-level ops ``top``),
    saying what to repair, and rank every layer (``rank``)."""
    repairable = repairable_layers(qmodel) - {TOP_LEVEL}
    for s in layers:
        if s.name in top:
            s.repairable, s.note = False, TOP_LEVEL_NOTE
            continue
        if s.name in repairable:
            continue
        readers = [c for c in consumer_layers(qmodel, s.name) if c in repairable]
        s.repairable = False
        where = ", ".join(repr(r) for r in readers) if readers else "the layers reading it"
        s.note = f"runs float, a rule naming it matches nothing: repair {where} instead"
    rank(layers)


def repair_rules(layers: list[str], base: Recipe, wider: str | None) -> list[Rule]:
    """The recipe rules for the repaired layers: skip, or int16 activations."""
    if wider is None:
        return [Rule(pattern=_glob_escape(layer), skip=True) for layer in layers]
    acts = base.activations
    wide = TensorRecipe(replace(acts.scheme, bits=16), acts.method, acts.options)
    return [Rule(pattern=_glob_escape(layer), activations=wide) for layer in layers]


def consumer_layers(qmodel: QuantModel, layer: str) -> list[str]:
    """The layers that read an activation ``layer`` quantizes (through data movement re-using
    its quantizer): a recipe that skips ``layer`` still quantizes that tensor where they read it,
    so keeping the tensor float takes skipping them too."""
    attrs = {p.attr for p in qmodel.qb_points if p.module == layer and p.kind == "activation"}
    prefix = CONTAINER + "."
    found: list[str] = []
    todo = [
        n
        for n in qmodel.graph.nodes
        if n.op == "call_module"
        and n.target.startswith(prefix)
        and n.target[len(prefix) :] in attrs
    ]
    seen = set(todo)
    while todo:
        for user in todo.pop().users:
            if user.op == "call_module" and user.target.startswith(prefix):
                if user not in seen:
                    seen.add(user)
                    todo.append(user)
                continue
            if user.op in ("call_function", "call_method", "call_module"):
                name = module_of(user)[0]
                if name != layer and name != INPUT_LAYER and name not in found:
                    found.append(name)
    return found


def _repair(result, subject: Subject, qmodel, ranked, measure, score, wider, max_verify, progress):
    """The set search of ``_sens_search`` on the switched-off estimate, then verified by
    re-quantizing; a miss adds the chosen layers' consumers (skip repair), then the next ranked
    layer; a met budget is pruned layer by layer on the verified metric."""
    budget = result.budget
    chosen, _ = estimate_search(ranked, measure, budget)
    position = {name: i for i, name in enumerate(ranked)}
    need_logits = result.metric == "top1"

    def verify(layers: list[str]) -> tuple[Recipe, float]:
        recipe = subject.recipe.with_rules(*repair_rules(layers, subject.recipe, wider))
        with stage(f"sensitivity: verifying the recipe ({len(layers)} layers)", progress):
            return recipe, score(subject.run(subject.quantize(recipe, False), need_logits))

    recipe, achieved = subject.recipe, result.baseline["quantized"]
    limit = max(1, max_verify)
    for attempt in range(limit):
        if not chosen and achieved >= budget:
            break  # the base recipe meets the budget already (measured above)
        recipe, achieved = verify(chosen)
        result.verified += 1
        nxt = _next_layer(qmodel, chosen, ranked, position, wider)
        if achieved >= budget or nxt is None or attempt == limit - 1:
            break
        chosen.append(nxt)
    if achieved >= budget and len(chosen) > 1 and result.verified < limit:
        best = {"recipe": recipe, "achieved": achieved}

        def meets(trial: list[str]) -> bool:
            if result.verified >= limit:
                return False  # max_verify spent: the layers not tried stay as they are
            result.verified += 1
            trial_recipe, value = verify(trial)
            if value >= budget:
                best.update(recipe=trial_recipe, achieved=value)
            return value >= budget

        chosen = prune(chosen, ranked, meets)
        recipe, achieved = best["recipe"], best["achieved"]
    result.recipe, result.achieved = recipe, achieved
    if wider is None:
        result.keep_float = list(chosen)
    else:
        result.wider = {layer: wider for layer in chosen}


def _next_layer(qmodel, chosen, ranked, position, wider) -> str | None:
    if wider is None:  # int16 keeps the consumers' reads on the wider grid; float does not
        consumers = {c for layer in chosen for c in consumer_layers(qmodel, layer)}
        consumers = [c for c in consumers if c in position and c not in chosen]
        if consumers:
            return min(consumers, key=position.__getitem__)
    return next((layer for layer in ranked if layer not in chosen), None)


def _bar(layers: list[str], progress: bool | None):
    """A tqdm bar over the layers on a terminal (a large model takes minutes), else as is."""
    if progress_enabled(progress) and sys.stderr.isatty():
        return tqdm(layers, desc="sensitivity", unit="layer", leave=False)
    return layers


def _glob_escape(name: str) -> str:
    """``name`` as an fnmatch pattern matching only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _key(value: float) -> float:
    return -math.inf if value is None or np.isnan(value) else value


def _finite(value: float | None) -> float | None:
    """JSON has no infinity: an infinite SQNR (identical outputs) is written as null."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.6g}"


__all__ = ["LayerSensitivity", "SensitivityResult", "layer_groups", "rank", "sensitivity"]
