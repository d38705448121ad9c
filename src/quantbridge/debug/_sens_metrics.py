"""Model-level metrics of ``sensitivity``: how close a quantized model's outputs are to the float
model's on an evaluation set. Every metric is "higher is better", so a budget is a lower bound.

Outputs are gathered per batch as ``Outputs``: ``flat`` holds one ``(batch, features)`` float64
array per batch (every float output of the model flattened per sample and concatenated), and
``logits`` the first output as ``(batch, classes)`` (``top1`` only).

* ``sqnr``: signal-to-quantization-noise ratio in dB over the whole set,
  ``10 * log10(sum(ref**2) / sum((out - ref)**2))`` (``inf`` when the outputs are identical);
* ``cosine``: the mean over samples of ``<ref, out> / (|ref| * |out|)`` (1.0 for a zero pair);
* ``top1``: the share of samples whose ``argmax`` equals the label when labels are given, else
  the float model's ``argmax`` (agreement with float).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Outputs:
    """A model's outputs over the evaluation set, per batch (see the module docstring)."""

    flat: list[np.ndarray] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)


def sqnr_db(ref: Outputs, out: Outputs, labels: np.ndarray | None = None) -> float:
    signal = sum(float(np.sum(r * r)) for r in ref.flat)
    noise = sum(float(np.sum((o - r) ** 2)) for r, o in zip(ref.flat, out.flat, strict=True))
    if noise == 0.0:
        return float("inf")
    if signal == 0.0:
        return float("-inf")
    return 10.0 * float(np.log10(signal / noise))


def mean_cosine(ref: Outputs, out: Outputs, labels: np.ndarray | None = None) -> float:
    values = []
    for r, o in zip(ref.flat, out.flat, strict=True):
        dot = np.sum(r * o, axis=1)
        norms = np.linalg.norm(r, axis=1) * np.linalg.norm(o, axis=1)
        values.append(np.where(norms > 0, dot / np.where(norms > 0, norms, 1.0), 1.0))
    return float(np.mean(np.concatenate(values)))


def top1(ref: Outputs, out: Outputs, labels: np.ndarray | None = None) -> float:
    predicted = np.concatenate([np.argmax(o, axis=1) for o in out.logits])
    if labels is None:
        target = np.concatenate([np.argmax(r, axis=1) for r in ref.logits])
    else:
        target = np.asarray(labels).reshape(-1)
        if target.shape != predicted.shape:
            raise ValueError(
                f"top1: {target.size} labels for {predicted.size} evaluation samples; give one "
                "label per sample"
            )
    return float(np.mean(predicted == target))


METRICS: dict[str, Callable[[Outputs, Outputs, np.ndarray | None], float]] = {
    "sqnr": sqnr_db,
    "cosine": mean_cosine,
    "top1": top1,
}


# the values a metric can take: a budget outside them is a unit mistake (a cosine of 40, a top-1
# of 98 for 98 %), refused instead of keeping every layer float in search of it
METRIC_RANGES: dict[str, tuple[float, float, str]] = {
    "cosine": (-1.0, 1.0, "a similarity such as 0.999; --metric sqnr takes dB"),
    "top1": (0.0, 1.0, "a fraction: 0.98 for 98 %"),
}


def check_budget(metric: str, budget: float) -> None:
    """ValueError for a ``budget`` the metric cannot reach, naming the metric's range."""
    if metric in METRIC_RANGES:
        lo, hi, hint = METRIC_RANGES[metric]
        if not lo <= budget <= hi:
            raise ValueError(
                f"budget {budget:g} is outside what {metric} can reach ([{lo:g}, {hi:g}]); "
                f"give {hint}"
            )


def metric_fn(name: str) -> Callable[[Outputs, Outputs, np.ndarray | None], float]:
    if name not in METRICS:
        raise ValueError(f"metric {name!r} is unknown; use one of {sorted(METRICS)}")
    return METRICS[name]
