"""The calibration calls the PTQ methods replay: which recipes need them, and how to collect them
from a user's ``forward_loop``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ...recipe import Recipe


def needs_batches(recipe: Recipe) -> bool:
    """Whether the recipe's methods run the calibration data more than once (so it is kept)."""
    return recipe.equalize or recipe.smoothquant is not None or recipe.bias_correction


class _Collector(nn.Module):
    """Stands in for the model inside ``forward_loop``: keeps each call's inputs, returns None."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.calls: list[tuple[tuple, dict]] = []

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


def collect_calls(forward_loop: Callable[[nn.Module], None], model: nn.Module) -> list:
    """The (args, kwargs) of every model call ``forward_loop`` makes (the model is not run: a
    loop that uses the model's outputs cannot be collected this way and raises)."""
    collector = _Collector(model)
    forward_loop(collector)
    return collector.calls
