"""Interleaved timing: warm up every runner, then rounds in which each runner runs once, the
start rotating from round to round, so load changes on a shared machine hit every runner alike.

A sample is the fastest of ``k`` back-to-back calls, ``k`` chosen per runner in the warm-up so a
sample spans about ``sample_ms`` (at most ``max_calls``): on 2 shared cores one inference of a
few milliseconds runs either at full speed or, when a worker thread is descheduled, nearly twice
as long (ResNet-18 batch 1: 6.5 or 12 ms, on identical optimized graphs), and single-call ratios
of such runs scatter over 0.5-2. Long inferences keep ``k = 1``.

Claims are ratios: ``paired_ratio(a, b)`` divides runner ``a``'s time by ``b``'s *within each
round* and reports the median and the spread of those per-round ratios, next to the ratio of the
medians. Process CPU time is recorded beside wall time (ORT spinning is off, so CPU time is the
work done and is less sensitive to other processes than wall time).
"""

from __future__ import annotations

import math
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
    sample_ms: float = 40.0,
    max_calls: int = 5,
    same_calls: bool = False,
) -> dict[str, dict[str, list[float]]]:
    """``{name: {"wall_ms": [...], "cpu_ms": [...], "calls": k}}`` over ``rounds`` interleaved
    rounds; each sample the fastest of ``k`` calls (module docstring).

    ``budget_s`` stops early (after at least ``min_rounds``) when the rounds so far took longer.
    ``same_calls``: every runner gets the same ``k`` (the fastest runner's), so the two forms of
    any ratio are minima over equally many calls (a minimum over more calls is lower by itself).
    """
    names = list(runners)
    warm_ms = {n: float("inf") for n in names}
    for _ in range(warmup):
        for name in names:
            t0 = time.perf_counter()
            runners[name]()
            warm_ms[name] = min(warm_ms[name], (time.perf_counter() - t0) * 1e3)
    calls = {n: calls_per_sample(warm_ms[n], sample_ms, max_calls) for n in names}
    if same_calls and calls:
        calls = dict.fromkeys(names, max(calls.values()))
    out = {n: {"wall_ms": [], "cpu_ms": [], "calls": calls[n]} for n in names}
    start = time.perf_counter()
    for r in range(rounds):
        if budget_s is not None and r >= min_rounds and time.perf_counter() - start > budget_s:
            break
        k = r % len(names)
        for name in names[k:] + names[:k]:
            time.sleep(gap_s)  # let the previous runtime's worker threads park
            best = (float("inf"), float("inf"))
            for _ in range(calls[name]):
                c0, t0 = time.process_time(), time.perf_counter()
                runners[name]()
                best = min(
                    best, ((time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3)
                )
            out[name]["wall_ms"].append(best[0])
            out[name]["cpu_ms"].append(best[1])
    return out


def calls_per_sample(warm_ms: float, sample_ms: float, max_calls: int) -> int:
    """Calls whose best makes one sample: enough to span ``sample_ms``, 1 to ``max_calls``."""
    if not warm_ms > 0:
        return max_calls
    return max(1, min(max_calls, math.ceil(sample_ms / warm_ms)))


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
