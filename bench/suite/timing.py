"""Interleaved timing: warm up every runner, then rounds in which each runner runs once, the
start rotating from round to round, so load changes on a shared machine hit every runner alike.

Claims are ratios: ``paired_ratio(a, b)`` divides runner ``a``'s time by ``b``'s *within each
round* and reports the median and the spread of those per-round ratios, next to the ratio of the
medians. Process CPU time is recorded beside wall time (ORT spinning is off, so CPU time is the
work done and is less sensitive to other processes than wall time).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleave(
    runners: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int = 2,
    gap_s: float = 0.01,
    budget_s: float | None = None,
    min_rounds: int = 3,
) -> dict[str, dict[str, list[float]]]:
    """``{name: {"wall_ms": [...], "cpu_ms": [...]}}`` over ``rounds`` interleaved rounds.

    ``budget_s`` stops early (after at least ``min_rounds``) when the rounds so far took longer.
    """
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            runners[name]()
    out = {n: {"wall_ms": [], "cpu_ms": []} for n in names}
    start = time.perf_counter()
    for r in range(rounds):
        if budget_s is not None and r >= min_rounds and time.perf_counter() - start > budget_s:
            break
        k = r % len(names)
        for name in names[k:] + names[:k]:
            time.sleep(gap_s)  # let the previous runtime's worker threads park
            c0, t0 = time.process_time(), time.perf_counter()
            runners[name]()
            out[name]["wall_ms"].append((time.perf_counter() - t0) * 1e3)
            out[name]["cpu_ms"].append((time.process_time() - c0) * 1e3)
    return out


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
    }


def paired_ratio(a: list[float], b: list[float]) -> dict[str, float]:
    """Per-round ``a / b`` (same round, adjacent in time): median, min, max; and the ratio of the
    medians. Below 1 means ``a`` took less time than ``b``."""
    per_round = [x / y for x, y in zip(a, b, strict=True) if y > 0]
    return {
        "median": statistics.median(per_round),
        "min": min(per_round),
        "max": max(per_round),
        "of_medians": statistics.median(a) / statistics.median(b),
        "n": len(per_round),
    }
