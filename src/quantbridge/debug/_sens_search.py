"""The repair search of ``sensitivity``: the set of layers to keep float (or wider) for a budget.

Per-layer effects do not add up (one layer's error can hide another's; two layers can quantize
the same tensor), so adding layers in single-layer rank order until the budget is met keeps more
layers than needed (MiniLM: 24 where 12 hand-picked ones do). The search therefore works on
sets, with two estimates of a set's metric:

* ``measure(kept)``: the switched-off estimate (the quantized model with ``kept``'s quantizers
  off; one evaluation pass, no calibration);
* ``verify(kept)``: the model quantized again with the recipe that repairs ``kept``, measured
  (one calibration and one evaluation; what the written recipe gives).

Steps:

1. **Forward** (estimate): at each step the best of adding one *family* (the layers that play the
   same role in repeated blocks: names equal up to the ``ModuleList`` index, e.g. every
   ``encoder.layer.#.output.dense``) or the next layer in rank order, until the budget is met.
   Without repeated blocks this is plain rank order.
2. **Backward** (estimate): each kept layer, least sensitive first, is put back to int8 when the
   estimate without it still meets the budget.
3. The caller verifies the set and grows it while the verified metric misses (``_sensitivity``).
4. **Backward, verified** (``prune_verified``): each kept layer, least sensitive first, is put
   back to int8 when the verified metric without it still meets the budget.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

Kept = list[str]

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")  # a ModuleList index: a whole dotted name component


def family_of(layer: str) -> str:
    """``layer``'s name with its ``ModuleList`` indices replaced by ``#``."""
    return _INDEX.sub("#", layer)


def families(layers: Sequence[str]) -> dict[str, list[str]]:
    """Family name -> its layers (in the given order); only families of two or more."""
    found: dict[str, list[str]] = {}
    for layer in layers:
        found.setdefault(family_of(layer), []).append(layer)
    return {name: members for name, members in found.items() if len(members) > 1}


def estimate_search(
    ranked: Sequence[str], measure: Callable[[Kept], float], budget: float
) -> tuple[Kept, int]:
    """Steps 1-2 on the switched-off estimate: the kept layers (rank order) and the number of
    estimates taken."""
    runs = 0

    def score(kept: Kept) -> float:
        nonlocal runs
        runs += 1
        value = measure(kept)
        return -math.inf if value is None or math.isnan(value) else value

    groups = list(families(ranked).values())
    kept: Kept = []
    current = score(kept)
    while current < budget:
        units = [[m for m in g if m not in kept] for g in groups]
        units = [u for u in units if u]
        nxt = next((layer for layer in ranked if layer not in kept), None)
        if nxt is None:
            break
        if [nxt] not in units:
            units.append([nxt])
        # the highest estimate; on a tie the unit with fewer layers
        scored = [(score(kept + u), u) for u in units]
        current, best = max(scored, key=lambda s: (s[0], -len(s[1])))
        kept = kept + best
    position = {name: i for i, name in enumerate(ranked)}
    kept = sorted(kept, key=position.__getitem__)
    return prune(kept, ranked, lambda trial: score(trial) >= budget), runs


def prune(kept: Kept, ranked: Sequence[str], meets: Callable[[Kept], bool]) -> Kept:
    """Each layer of ``kept``, least sensitive (last in ``ranked``) first, is dropped when the
    set without it still ``meets`` the budget. Keeps ``kept``'s order."""
    position = {name: i for i, name in enumerate(ranked)}
    for layer in sorted(kept, key=lambda n: position.get(n, len(position)), reverse=True):
        trial = [k for k in kept if k != layer]
        if meets(trial):
            kept = trial
    return kept


__all__ = ["estimate_search", "families", "family_of", "prune"]
