"""The calibration calls the PTQ methods replay: which recipes need them, and how to collect them
from a user's ``forward_loop``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ...recipe import Recipe
from .._collective import is_distributed


def needs_batches(recipe: Recipe) -> bool:
    """Whether the recipe's methods run the calibration data more than once (so it is kept).
    Under ``torch.distributed`` they would see only this rank's shard and give every rank other
    weights: refused with the fix (combining their statistics across ranks is not done yet)."""
    wanted = [
        name
        for name, on in (
            ("equalize", recipe.equalize),  # its high-bias absorption reads the data
            ("smoothquant", recipe.smoothquant is not None),
            ("bias_correction", recipe.bias_correction),
            ("split_ranges", recipe.split_ranges),  # the channel ranges it cuts on
            ("weight_ranges", recipe.weight_ranges == "output"),  # its E[x^2] per input
            ("distill_steps", recipe.distill_steps > 0),  # steps over the batches
        )
        if on
    ]
    if wanted and is_distributed():
        raise ValueError(
            f"Recipe {', '.join(wanted)}: these methods measure the calibration data on one "
            "process; under torch.distributed every rank would compute other weights. Quantize "
            "on one rank (inside quantbridge.torch._distributed.local_statistics()) and "
            "broadcast the model, or switch them off"
        )
    return bool(wanted)


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
