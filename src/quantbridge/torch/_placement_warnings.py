"""The warnings of the placement walk (``_placement``): layers with weights that stay float, and
recipe rules that match no layer of the model."""

from __future__ import annotations

import warnings

from ..recipe import Recipe
from ._capture import user_stacklevel
from ._float_layers import unknown_readers


def warn_placement(recipe: Recipe, left_float: list, seen_modules: set, graph=None) -> None:
    """``left_float``: (layer, reason) of weighted ops no rule skips that stay float;
    ``seen_modules``: the (module path, type name) pairs the walk met; ``graph``: the placed
    graph, whose ops of other libraries reading parameters are named too (``unknown_readers``)."""
    if graph is not None:
        named = {name for name, _ in left_float}
        left_float = left_float + [
            (name, why) for name, module_type, why in unknown_readers(graph.owning_module)
            if name not in named and not recipe.for_module(name, module_type)[0]
        ]  # fmt: skip
    left_float = list(dict.fromkeys(left_float))  # a loop's steps: one entry per layer and why
    if left_float:
        shown = "; ".join(f"{name!r}: {why}" for name, why in left_float[:6])
        more = f" and {len(left_float) - 6} more" if len(left_float) > 6 else ""
        warnings.warn(
            f"{len(left_float)} layer(s) with weights stay float (no int8 form): {shown}"
            f"{more}. Rewrite them as a supported layer, or skip them with "
            "Rule(pattern=..., skip=True) to keep them float knowingly",
            stacklevel=user_stacklevel(),
        )
    names = sorted(m for m, _ in seen_modules if m)
    types = sorted({t for _, t in seen_modules})
    for rule in recipe.unmatched_rules(sorted(seen_modules)):
        warnings.warn(
            f"recipe rule {rule.describe()} matches no layer of the model"
            f"{rule.closest(names, types)}; known "
            f"layers include {names[:8]}, types {types[:8]}",
            stacklevel=user_stacklevel(),
        )
