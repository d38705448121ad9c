"""The parts a ``Recipe`` is built from: ``TensorRecipe`` (how weights or activations are quantized
and calibrated), ``Rule`` (per-layer overrides), ``AdaRound`` (learned-weight-rounding settings),
and the key check every part uses when it is read from a dict (``check_keys``). Re-exported by ``quantbridge.recipe``; kept in
its own module so that ``recipe.py`` (the recipe and its presets) stays under the size cap."""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass
from typing import Any

from .numerics import QScheme

_METHODS = ("minmax", "moving_average_minmax", "mean_minmax", "percentile", "entropy", "mse")


def did_you_mean(name: Any, choices: Any) -> str:
    """' (did you mean 'x'?)' for the closest of ``choices`` to a misspelled ``name``, else ''."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_keys(d: Any, allowed: set[str], where: str) -> None:
    if not isinstance(d, dict):
        raise TypeError(f"{where} must be a mapping, got {type(d).__name__}")
    for key in d:
        if key not in allowed:
            raise ValueError(
                f"unknown key {key!r} in {where}{did_you_mean(key, allowed)}; allowed keys: "
                f"{sorted(allowed)}"
            )


# where ``Recipe.smoothquant`` may act: every linear input, or ("transformer") only graphs where a
# LayerNorm feeds a linear and there only inputs with outlier channels (``torch.ptq._smoothquant``)
SMOOTHQUANT_SCOPES = ("all", "transformer")
# which activations get quantizers: every op input / output placement knows ("all"), or only the
# inputs of weighted ops and both operands of activation x activation matmuls, every element-wise
# op float ("weighted_inputs", ``torch._scope``)
ACTIVATION_SCOPES = ("all", "weighted_inputs")


def check_choice(what: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(
            f"{what}={value!r}{did_you_mean(value, choices)}: use one of {list(choices)}"
        )


def later_value(key: str, value: Any, off: Any) -> Any:
    """A later recipe option read from a dict: as its off value's type, except a mode string
    (``reader_bounds="all"``)."""
    return value if isinstance(value, str) and key == "reader_bounds" else type(off)(value)


def check_count(what: str, value: Any) -> None:
    """ValueError unless ``value`` is an int >= 0 (0: the option is off)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0 (0: off), got {value!r}")


def check_pair_safe(pair_safe_weights: Any, adaround: Any, distill_steps: int) -> None:
    """``Recipe.pair_safe_weights``: a bool, and alone of the methods that rewrite weight codes."""
    if not isinstance(pair_safe_weights, bool):
        raise ValueError(
            f"Recipe.pair_safe_weights must be True or False, got {pair_safe_weights!r}"
        )
    if pair_safe_weights and (adaround is not None or distill_steps):
        raise ValueError(
            "Recipe.pair_safe_weights: AdaRound and distillation rewrite the weight codes after "
            "it and would break the pair bound; use pair_safe_weights without them"
        )


def check_bias_correction(bias_correction: Any, mask: Any, check: Any, shrink: Any = False) -> None:
    """``Recipe.bias_correction``, ``bias_correction_mask`` (read only by the sequential
    correction), ``bias_correction_check`` and ``bias_correction_shrink`` (sequential only)."""
    if bias_correction not in (False, True, "sequential"):
        raise ValueError(
            f"Recipe.bias_correction={bias_correction!r}: use False, True (one pass) or"
            " 'sequential' (layer by layer)"
        )
    if not isinstance(mask, str):
        raise TypeError(
            f"Recipe.bias_correction_mask={mask!r}: the name of a keyword input (e.g."
            " 'attention_mask'), or '' for every position"
        )
    if mask and bias_correction != "sequential":
        raise ValueError(
            f"Recipe.bias_correction_mask={mask!r} with bias_correction={bias_correction!r}: only"
            " the sequential correction reads the mask; set bias_correction='sequential' or"
            " bias_correction_mask=''"
        )
    if not isinstance(check, bool) or (check and not bias_correction):
        raise ValueError(
            f"Recipe.bias_correction_check={check!r} with bias_correction={bias_correction!r}:"
            " a bool, True only with a bias correction (True or 'sequential')"
        )
    if not isinstance(shrink, bool) or (shrink and bias_correction != "sequential"):
        raise ValueError(
            f"Recipe.bias_correction_shrink={shrink!r} with bias_correction={bias_correction!r}:"
            " a bool, True only with bias_correction='sequential' (the pass that measures"
            " per-sample errors)"
        )


@dataclass(frozen=True)
class AdaRound:
    """AdaRound (Nagel et al. 2020): learn each weight's rounding, floor or ceil, layer by layer
    (``quantbridge.torch.ptq``). ``Recipe(adaround=AdaRound())``; in a dict ``"adaround": true``
    or the fields below. Scales stay as calibrated; only the integer weights change.

    ``iterations`` Adam steps per layer on batches of ``batch_rows`` sampled rows (a conv's
    im2col patches, a linear's tokens) out of ``rows`` cached per layer from at most
    ``calib_batches`` calibration batches; ``reg_weight`` weights the rounding regulariser,
    whose ``beta`` anneals from ``beta_start`` to ``beta_end`` after the first ``warmup``
    fraction of the steps (regulariser off before); ``lr`` is Adam's step size. ``drop``
    (QDrop, Wei et al. 2022; 0 = off): in each step every input element of the layer is the
    float model's value with this probability, else the quantized model's, so that the rounding
    is not fitted to one particular pattern of upstream activation rounding."""

    iterations: int = 300
    batch_rows: int = 256
    rows: int = 4096
    calib_batches: int = 16
    reg_weight: float = 5.0
    beta_start: float = 20.0
    beta_end: float = 2.0
    warmup: float = 0.2
    lr: float = 5e-2
    drop: float = 0.0

    def __post_init__(self) -> None:
        for name in ("iterations", "batch_rows", "rows", "calib_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"AdaRound.{name} must be a positive integer, got {v!r}")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"AdaRound.warmup must lie in [0, 1), got {self.warmup!r}")
        if isinstance(self.drop, bool) or not 0.0 <= self.drop < 1.0:
            raise ValueError(f"AdaRound.drop must lie in [0, 1), got {self.drop!r}")
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


def check_tensor_recipe(where: str, value: Any, optional: bool = False) -> None:
    """TypeError naming ``where`` unless ``value`` is a TensorRecipe (or None when ``optional``);
    a bare QScheme, the usual slip, is shown wrapped."""
    if isinstance(value, TensorRecipe) or (optional and value is None):
        return
    fix = ""
    if isinstance(value, QScheme):
        fix = f": wrap the scheme, {where.rsplit('.', 1)[-1]}=qb.TensorRecipe(qb.QScheme(...))"
    raise TypeError(f"{where} must be a TensorRecipe, got {value!r}{fix}")


@dataclass(frozen=True)
class TensorRecipe:
    """How one kind of tensor (weights or activations) is quantized and calibrated."""

    scheme: QScheme
    method: str = "minmax"
    options: tuple[tuple[str, Any], ...] = ()  # calibration options, e.g. (("percentile", 99.99),)

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, QScheme):
            raise TypeError(f"TensorRecipe.scheme must be a QScheme, got {self.scheme!r}")
        if self.method not in _METHODS:
            raise ValueError(
                f"calibration method {self.method!r} is unknown"
                f"{did_you_mean(self.method, _METHODS)}; use one of {list(_METHODS)}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme.to_dict(),
            "method": self.method,
            "options": dict(self.options),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> TensorRecipe:
        check_keys(d, {"scheme", "method", "options"}, where)
        return cls(
            scheme=QScheme.from_dict(d.get("scheme", {})),
            method=d.get("method", "minmax"),
            options=tuple(sorted(dict(d.get("options", {})).items())),
        )


@dataclass(frozen=True)
class Rule:
    """Override for the layers whose module name matches ``pattern`` (fnmatch glob) and/or whose
    module class name equals ``module_type``. ``skip=True`` leaves them in float."""

    pattern: str | None = None
    module_type: str | None = None
    skip: bool = False
    weights: TensorRecipe | None = None
    activations: TensorRecipe | None = None

    def closest(self, names: list[str], types: list[str]) -> str:
        """' (did you mean ...?)' with the layer name or type nearest to a rule matching none."""
        if self.module_type is not None:
            return did_you_mean(self.module_type, types)
        return did_you_mean(self.pattern, names)

    def __post_init__(self) -> None:
        if self.pattern is None and self.module_type is None:
            raise ValueError("a Rule needs a 'pattern' (module name glob) or a 'module_type'")
        for key in ("pattern", "module_type"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"Rule.{key} must be a string (e.g. 'layer4.*', 'Linear'), got {value!r}"
                )
        check_tensor_recipe("Rule.weights", self.weights, optional=True)
        check_tensor_recipe("Rule.activations", self.activations, optional=True)
        if self.skip and (self.weights is not None or self.activations is not None):
            raise ValueError(
                f"Rule {self.describe()}: 'skip' together with scheme overrides is contradictory;"
                " keep one"
            )

    def describe(self) -> str:
        parts = [f"pattern={self.pattern!r}"] if self.pattern is not None else []
        if self.module_type is not None:
            parts.append(f"module_type={self.module_type!r}")
        return "(" + ", ".join(parts) + ")"

    def matches(self, module_name: str, module_type: str) -> bool:
        if self.pattern is not None and not fnmatch.fnmatchcase(module_name, self.pattern):
            return False
        return self.module_type is None or self.module_type == module_type

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.pattern is not None:
            d["pattern"] = self.pattern
        if self.module_type is not None:
            d["module_type"] = self.module_type
        if self.skip:
            d["skip"] = True
        if self.weights is not None:
            d["weights"] = self.weights.to_dict()
        if self.activations is not None:
            d["activations"] = self.activations.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> Rule:
        check_keys(d, {"pattern", "module_type", "skip", "weights", "activations"}, where)
        w, a = d.get("weights"), d.get("activations")
        return cls(
            pattern=d.get("pattern"),
            module_type=d.get("module_type"),
            skip=bool(d.get("skip", False)),
            weights=TensorRecipe.from_dict(w, f"{where}.weights") if w is not None else None,
            activations=TensorRecipe.from_dict(a, f"{where}.activations")
            if a is not None
            else None,
        )
