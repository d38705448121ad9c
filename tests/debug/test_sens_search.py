"""The repair search of ``qb.sensitivity`` (``debug._sens_search``) on set functions whose
optimum is known by construction: per-layer effects that do not add up, so that adding layers
in single-layer rank order keeps more than needed.
"""

from __future__ import annotations

import itertools

import pytest

from quantbridge.debug._sens_search import estimate_search, families, family_of, prune
from quantbridge.debug._sensitivity import LayerSensitivity, rank

BUDGET = 0.999


def masking(kept: list[str]) -> float:
    """``a`` and ``b`` each wipe the same signal when quantized (error 0.1 once, not twice: one
    hides the other); ``z`` adds an independent 0.0005. Optimum for 0.999: keep {a, b} (0.9995)."""
    err = 0.1 if not {"a", "b"} <= set(kept) else 0.0
    err += 0.0005 if "z" not in kept else 0.0
    return 1.0 - err


def ranked_by_sensitivity(layers: list[str], metric) -> list[str]:
    """The library's ranking, from the two single-layer measurements of ``metric``."""
    rows = [
        LayerSensitivity(n, "Linear", metric([m for m in layers if m != n]), metric([n]))
        for n in layers
    ]
    return rank(rows)


def smallest(layers: list[str], metric, budget: float) -> list[set[str]]:
    """Every smallest set meeting the budget, by exhaustive search."""
    for size in range(len(layers) + 1):
        found = [set(c) for c in itertools.combinations(layers, size) if metric(list(c)) >= budget]
        if found:
            return found
    return []


def rank_order_greedy(ranked: list[str], metric, budget: float) -> list[str]:
    """What sensitivity did before the set search: add layers in rank order."""
    kept: list[str] = []
    for layer in ranked:
        if metric(kept) >= budget:
            break
        kept.append(layer)
    return kept


def test_masking_layers_rank_order_over_keeps_and_the_search_does_not():
    layers = ["a", "b", "z"]
    ranked = ranked_by_sensitivity(layers, masking)
    # keeping z float alone gives 0.9 (a, b still wipe); keeping a alone gives 0.8995: z ranks first
    assert ranked[0] == "z"
    greedy = rank_order_greedy(ranked, masking, BUDGET)
    assert len(greedy) == 3  # z, then a and b: provably one more than needed
    assert smallest(layers, masking, BUDGET) == [{"a", "b"}]
    kept, runs = estimate_search(ranked, masking, BUDGET)
    assert set(kept) == {"a", "b"} and masking(kept) >= BUDGET
    assert runs <= 8  # 1 + 3 forward steps + 3 backward trials


def blocks_metric(kept: list[str]) -> float:
    """Six repeated blocks: each ``layer.N.out`` costs 0.004 when quantized, each
    ``layer.N.inp`` 0.0001. Only set of six for 0.999: the six ``out`` layers (0.9994; any set
    without one of them has an error of at least 0.004)."""
    err = 0.0
    for n in range(6):
        err += 0.0 if f"layer.{n}.out" in kept else 0.004
        err += 0.0 if f"layer.{n}.inp" in kept else 0.0001
    return 1.0 - err


def test_families_group_the_same_role_across_blocks():
    assert family_of("bert.encoder.layer.11.output.dense") == "bert.encoder.layer.#.output.dense"
    assert family_of("fc2") == "fc2" and family_of("layer1.0.conv1") == "layer1.#.conv1"
    layers = [f"layer.{n}.{role}" for n in range(3) for role in ("inp", "out")] + ["head"]
    assert families(layers) == {
        "layer.#.inp": ["layer.0.inp", "layer.1.inp", "layer.2.inp"],
        "layer.#.out": ["layer.0.out", "layer.1.out", "layer.2.out"],
    }


def test_a_family_is_found_in_one_step():
    layers = [f"layer.{n}.{role}" for n in range(6) for role in ("inp", "out")]
    ranked = ranked_by_sensitivity(layers, blocks_metric)
    assert smallest(layers, blocks_metric, BUDGET) == [{f"layer.{n}.out" for n in range(6)}]
    kept, runs = estimate_search(ranked, blocks_metric, BUDGET)
    assert set(kept) == {f"layer.{n}.out" for n in range(6)}
    # one forward step (2 families + the next ranked layer) and 6 backward trials
    assert runs == 1 + 3 + 6


@pytest.mark.parametrize("order", [["a", "b", "c"], ["c", "b", "a"]])
def test_prune_drops_least_sensitive_first_and_keeps_the_order(order):
    calls: list[list[str]] = []

    def meets(trial):  # c is enough on its own
        calls.append(trial)
        return "c" in trial

    kept = prune(["a", "b", "c"], order, meets)
    assert kept == ["c"]
    assert calls[0] == [x for x in ["a", "b", "c"] if x != order[-1]]
