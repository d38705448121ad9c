"""``AdaRound``, the recipe's learned-weight-rounding settings, and the key check every recipe part
uses when it is read from a dict (``check_keys``). Re-exported by ``quantbridge.recipe``; kept in
its own module so that ``recipe.py`` (the recipe and its presets) stays under the size cap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def check_keys(d: Any, allowed: set[str], where: str) -> None:
    if not isinstance(d, dict):
        raise TypeError(f"{where} must be a mapping, got {type(d).__name__}")
    for key in d:
        if key not in allowed:
            raise ValueError(f"unknown key {key!r} in {where}; allowed keys: {sorted(allowed)}")


# where ``Recipe.smoothquant`` may act: every linear input, or ("transformer") only graphs where a
# LayerNorm feeds a linear and there only inputs with outlier channels (``torch.ptq._smoothquant``)
SMOOTHQUANT_SCOPES = ("all", "transformer")


def check_choice(what: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{what}={value!r}: use one of {list(choices)}")


@dataclass(frozen=True)
class AdaRound:
    """AdaRound (Nagel et al. 2020): learn each weight's rounding, floor or ceil, layer by layer
    (``quantbridge.torch.ptq``). ``Recipe(adaround=AdaRound())``; in a dict ``"adaround": true``
    or the fields below. Scales stay as calibrated; only the integer weights change.

    ``iterations`` Adam steps per layer on batches of ``batch_rows`` sampled rows (a conv's
    im2col patches, a linear's tokens) out of ``rows`` cached per layer from at most
    ``calib_batches`` calibration batches; ``reg_weight`` weights the rounding regulariser,
    whose ``beta`` anneals from ``beta_start`` to ``beta_end`` after the first ``warmup``
    fraction of the steps (regulariser off before); ``lr`` is Adam's step size."""

    iterations: int = 300
    batch_rows: int = 256
    rows: int = 4096
    calib_batches: int = 16
    reg_weight: float = 5.0
    beta_start: float = 20.0
    beta_end: float = 2.0
    warmup: float = 0.2
    lr: float = 5e-2

    def __post_init__(self) -> None:
        for name in ("iterations", "batch_rows", "rows", "calib_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"AdaRound.{name} must be a positive integer, got {v!r}")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"AdaRound.warmup must lie in [0, 1), got {self.warmup!r}")
        for name in ("reg_weight", "beta_start", "beta_end", "lr"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"AdaRound.{name} must be positive, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_value(cls, value: Any, where: str) -> AdaRound | None:
        """``True`` -> the defaults, ``False`` / ``None`` -> off, a mapping -> those fields."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        check_keys(value, set(cls.__dataclass_fields__), where)
        return cls(**value)
