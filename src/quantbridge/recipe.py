"""Recipes: what to quantize and how, as plain, serialisable data.

A ``Recipe`` is the one object that drives every path (PTQ, QAT, export). It says how weights and
activations are quantized (a ``QScheme`` plus a calibration method each), and holds ``Rule``s keyed
by module-name pattern or module type that skip a layer or override its schemes - the "filter
function" users write by hand today, as data.

Round trip: ``Recipe.from_dict(r.to_dict()) == r``; JSON and YAML go through the dict. Unknown keys
and impossible combinations raise ``ValueError`` naming the key.

Presets (``Recipe.preset(name)``, or pass the name to ``quantize``):

* ``"default"``: what ``qb.quantize``, ``qb.quantize_onnx`` and ``quantbridge quantize`` use
  without a recipe - ``int8_avx2`` (7-bit weights) with activations calibrated by ``mse``,
  float graph outputs and sequential bias correction; see "The default" below for why.
* ``"int8"`` (``Recipe()``): weights int8 symmetric narrow range ([-127, 127]) per output channel;
  activations uint8 asymmetric per tensor, minmax; bias int32 with scale = input x weight scale.
  uint8 activations because x86 engines run u8 x s8 kernels (VNNI ``vpdpbusd``): ONNX Runtime runs
  a QDQ ResNet-18 about 3x faster with uint8 than with int8 activations on this machine.
* ``"int8_symmetric"``: as ``int8`` with int8 symmetric activations (zero point 0), for integer
  accelerators that want zero points of 0.
* ``"int8_avx2"``: as ``int8`` with 7-bit weights ([-63, 63], still stored as int8), for x86
  CPUs without VNNI: their int8 kernels (ONNX Runtime, OpenVINO) add pairs of uint8 x int8
  products in int16 with saturation, which full-range weights overflow (see
  ``quantbridge._platform``; measured ResNet-18-style in ORT: 72% -> 100% of outputs within 1 LSB).
* ``"native"``: ``int8_avx2`` on a CPU whose engines saturate (x86 without VNNI), ``int8``
  elsewhere - for a model that runs exactly on the machine that quantizes it (the demo's default).
  It resolves to the concrete recipe when used, so checkpoints and exports record that one.
* ``"w4a8"``: 4-bit symmetric per-channel weights, uint8 activations.
* ``"transformer"``: ``int8`` plus ``smoothquant="auto"`` and ``float_outlier_residuals``: the
  residual adds whose outputs carry outlier channels (found on the calibration data, read by a
  layer norm) stay float, every linear int8 (``quantbridge.torch._outliers``); for BERT-like
  encoders and GPT-style decoders.
* ``"pow2"``: int8 symmetric weights and activations with power-of-two scales (shift-only rescale).
* ``"int8_adaround"``: ``int8`` plus AdaRound (``AdaRound``, ``quantbridge.torch.ptq``): each
  weight's rounding (floor or ceil) learned layer by layer on the calibration data; opt-in because
  it costs minutes on a ResNet-18 (see ``PRESETS``). ``Recipe(adaround=True)`` adds it to any recipe.

Post-training methods (``quantbridge.torch.ptq``; off in every preset, switched on per recipe,
e.g. ``dataclasses.replace(Recipe.preset("native"), equalize=True, bias_correction=True)``):
``equalize`` (cross-layer equalization through ReLU, with high-bias absorption), ``smoothquant``
(an alpha in [0, 1] or ``"auto"``: outlier migration from linear inputs into their weights),
``bias_correction`` (empirical, layer by layer, from the calibration data).

``activation_scope="weighted_inputs"`` (off, ``"all"``, in every preset): only the inputs of
conv / linear and both matmul operands are quantized, every element-wise op float (NNCF's
transformer layout; ``torch._scope``, docs/attention.md): MiniLM-L6 with SmoothQuant "auto"
0.9965 mean cosine in ORT vs 0.9928 for the ``transformer`` preset; not integer-only. On CNNs it
is ModelOpt's layout (conv inputs only, residual adds float; ORT runs a conv whose output is not
quantized in float on its int8 inputs): the bench's row ``peers.CONV_INPUTS``.

Every preset also puts the constant operand of a quantized add / mul (``x * 0.1666``, ``x + 3.0``,
``x * buffer``) on its own integer grid (``quantize_constants``), as ONNX Runtime's quantizer
does, so that engines run those ops in integer (QLinearAdd / QLinearMul).

``Recipe(reader_bounds=True)`` (off in every preset): with minmax activations (``"all"``: any
method), a value only hard-swish (``x * clamp(x + 3, 0, 6)``), relu or clamp read is calibrated on
the interval they tell apart (``torch._reader_ranges``; PP-OCRv4 det "default" 13.21 -> 14.94 dB
node by node, but the recognizer reads 47% of 64 lines instead of 80%; without bias correction it
lifts the recognizer 50% -> 73%: the conflict is unexplained, so opt-in).

``Recipe(split_ranges=True)`` (off in every preset): a conv whose output channels differ widely
in range (through hard-swish, which no per-channel scale commutes with) becomes one conv per
range group, each group on its own int8 grids, rescaled to one range where the groups meet again
(``torch.ptq._split_ranges``; float function unchanged; the cut weighs each channel's noise by
the readers' weights on it; the common range's factors balance the readers' activation and
weight rounding, ``torch.ptq._concat_ranges``, which also brings the parts of a channel
concatenation that convs read to one range). PP-OCRv4 det: ``bench.suite.peers.SPLIT_RANGES``;
ResNet-18-style: one split; MobileNetV2-style (ReLU6): none. Opt-in: it adds convs (time).

The default (issue 14) was chosen by measurement across the bench workloads; the tables,
the peers' defaults and the reasons are in ``docs/default_recipe.md`` (7-bit weights + float
outputs + sequential bias correction: the only combination at or above every peer's default on
every bench workload; sequential correction +3.3 dB on the PP-OCRv4 detector and +20 points of
the recognizer's 256 lines over one-pass, -0.023 cosine on MiniLM-L6, traced to padded
positions, see ``Recipe.bias_correction_mask`` / ``bias_correction_check``; activations by
``mse``: ahead of NNCF's default on the detector at the full bench sizes too, see ``PRESETS``).

Weights are 7-bit ([-63, 63], stored as int8) on every machine, not ``native``: a file made
with 8-bit weights on a VNNI CPU runs several LSB off in ONNX Runtime and OpenVINO on an x86
CPU without VNNI (``quantbridge._platform``), and ``native`` would make the same call write a
different file on each machine. 7-bit weights run exactly on every x86 CPU and, with bias
correction, cost almost nothing: node by node (VNNI-exact) ResNet-18-style 44.74 dB vs 44.77
with 8-bit weights (which score 38.01 dB fused here). ``recipe="int8"`` (``"native"`` on a VNNI
CPU) gives full-range weights and quantized outputs. Float outputs: the logits are the last
layer's result dequantized, not rounded to a 256-step grid; ``qb.lower`` / ``integer_mode`` end
the integer program at that layer's int32 accumulator (``float_outputs="dequantize"``, their
default). QAT (``prepare_qat``) keeps ``"int8"`` as its default.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ._platform import u8s8_saturates
from ._recipe_parts import (
    ACTIVATION_SCOPES,
    SMOOTHQUANT_SCOPES,
    AdaRound,
    Rule,
    TensorRecipe,
    check_bias_correction,
    check_choice,
    check_count,
    check_pair_safe,
    check_tensor_recipe,
    did_you_mean,
    later_value,
)
from ._recipe_parts import check_keys as _check_keys
from .numerics import PerBlock, PerChannel, PerTensor, QScheme

__all__ = ["AdaRound", "Recipe", "Rule", "TensorRecipe", "native_preset", "resolve_recipe"]


def _default_weights() -> TensorRecipe:
    return TensorRecipe(QScheme(8, True, True, True, PerChannel(0)), "minmax")


def _default_activations() -> TensorRecipe:
    return TensorRecipe(QScheme(8, False, False, False, PerTensor()), "minmax")


# Recipe options added after the format settled -> their off value (written only when set)
_LATER = {
    "float_outlier_residuals": False,
    "fold_affine": False,
    "smoothquant_scope": "all",
    "activation_scope": "all",
    "reader_bounds": False,
    "split_ranges": False,
    "bias_correction_mask": "",
    "bias_correction_check": False,
    "bias_correction_shrink": False,
    "weight_ranges": "minmax",
    "distill_steps": 0,
    "pair_safe_weights": False,
}


@dataclass(frozen=True)
class Recipe:
    """The whole quantization plan. See the module docstring for the presets."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Recipe:
        # a misspelled option gets the right name, not only "unexpected keyword argument"
        names = [f.name for f in fields(cls)]
        for key in kwargs:
            if key not in names:
                raise TypeError(f"Recipe has no option {key!r}{did_you_mean(key, names)}")
        return super().__new__(cls)

    weights: TensorRecipe = field(default_factory=_default_weights)
    activations: TensorRecipe = field(default_factory=_default_activations)
    rules: tuple[Rule, ...] = ()
    align_concat_inputs: bool = True  # cat inputs share the output's parameters (pure data move)
    align_add_inputs: bool = False  # residual add inputs share parameters (integer-only targets)
    opset: int | None = None  # ONNX opset for export; None = the lowest the schemes allow (>= 13)
    # the constant operand (scalar, buffer) of a quantized add / mul gets its own integer grid, as
    # in ONNX Runtime's quantizer: the export then fuses into QLinearAdd / QLinearMul
    quantize_constants: bool = True
    # False: a value read only as a graph output (through flatten / reshape / dropout) stays
    # float (ResNet-18-style logits, ORT node-by-node: 40.13 -> 43.22 dB); the "default" preset.
    # ``qb.lower`` then ends the program at the last layer's int32 accumulator.
    quantize_outputs: bool = True
    # post-training accuracy methods (``quantbridge.torch.ptq``): cross-layer equalization of
    # conv/linear pairs through ReLU; SmoothQuant outlier migration into linears, alpha a number
    # in [0, 1] or "auto" (searched per layer); empirical bias correction, True (one float pass,
    # each layer's own error) or "sequential" (layer by layer, upstream drift too).
    # Off in ``Recipe()`` and every preset but "default" (module docstring: where they pay;
    # each one alone: docs/default_recipe.md, "Post-training methods alone").
    equalize: bool = False
    # fold constant ``* k`` / ``+ t`` next to a conv/linear into it (``torch._fold_affine*``); off:
    # PP-OCRv4 det mse +2.2 dB, but rec 95.3% -> 84.4% lines (64) with the same final grids
    fold_affine: bool = False
    # calibration of a value only hard-swish / relu / clamp read on their interval, minmax only
    # (True) or every method ("all"): ``torch._reader_ranges``; off: rec (default) 80% -> 47%
    reader_bounds: bool | str = False
    # a conv whose output channels differ widely in range (through hard-swish...) becomes one
    # conv per range group, each with its own grids (``torch.ptq._split_ranges``); exact in float
    split_ranges: bool = False
    smoothquant: float | str | None = None
    smoothquant_scope: str = "all"  # or "transformer" (``_recipe_parts.SMOOTHQUANT_SCOPES``)
    bias_correction: bool | str = False
    # a keyword input ("attention_mask") whose zeros sequential bias correction's means skip
    bias_correction_mask: str = ""
    # keep the corrected biases only if the output error on the calibration data fell
    bias_correction_check: bool = False
    # shrink each channel's sequential correction by its calibration standard error (over the
    # samples): c * c^2 / (c^2 + se^2) (``numerics.shrink_bias_shift``); few samples fit noise
    bias_correction_shrink: bool = False
    adaround: AdaRound | None = None  # learned weight rounding after calibration (see AdaRound)
    # output distillation, last: Adam steps learning weight gains (codes kept) and biases against
    # the float model's outputs on the calibration data (``torch.ptq._distill``); 0 = off
    distill_steps: int = 0
    # per-channel weight scales (symmetric signed): "minmax", or the clip with the least squared
    # rounding error, each weight counted alike ("mse") or by its input's E[x^2] on the
    # calibration data ("output": the layer's output error; Var(x) with bias correction, which
    # removes the error's mean); ``torch.ptq._weight_ranges``
    weight_ranges: str = "minmax"
    # 8-bit codes no int16 pair sum saturates on x86 without VNNI (``torch.ptq._pair_bound``)
    pair_safe_weights: bool = False
    # residual adds read by a layer norm whose channels hold outliers stay float, found on the
    # first calibration batch and recorded as skip rules (``torch._outliers``; preset "transformer")
    float_outlier_residuals: bool = False
    # "weighted_inputs": only the inputs of conv / linear and both operands of activation x
    # activation matmuls get activation quantizers; adds, norms, softmax... stay float, no output
    # is quantized (``torch._scope``, ``_recipe_parts.ACTIVATION_SCOPES``). Not integer-only.
    activation_scope: str = "all"

    def __post_init__(self) -> None:
        object.__setattr__(self, "adaround", AdaRound.from_value(self.adaround, "Recipe.adaround"))
        for what, tr in (("weights", self.weights), ("activations", self.activations)):
            check_tensor_recipe(f"Recipe.{what}", tr)
        if isinstance(self.activations.scheme.granularity, PerChannel):
            raise ValueError(
                "Recipe.activations: per-channel activation quantization is not supported"
                " (ONNX Runtime's int8 kernels take one activation scale); use PerTensor()"
            )
        for what, tr in (("weights", self.weights), ("activations", self.activations)):
            if isinstance(tr.scheme.granularity, PerBlock):
                raise ValueError(
                    f"Recipe.{what}: per-block (group-wise) parameters come only from imported "
                    "files (qb.import_onnx); calibration does not choose them. Use PerChannel(0)"
                )
        if self.opset is not None and self.opset < 13:
            raise ValueError(f"Recipe.opset={self.opset}: QDQ export needs opset >= 13")
        object.__setattr__(self, "rules", tuple(self.rules))
        sq = self.smoothquant
        if sq is not None and sq != "auto":
            if isinstance(sq, bool) or not isinstance(sq, (int, float)) or not 0.0 <= sq <= 1.0:
                raise ValueError(
                    f"Recipe.smoothquant={sq!r}: use an alpha in [0, 1], 'auto' (searched per"
                    " layer) or None (off)"
                )
            object.__setattr__(self, "smoothquant", float(sq))
        check_choice("Recipe.smoothquant_scope", self.smoothquant_scope, SMOOTHQUANT_SCOPES)
        check_choice("Recipe.activation_scope", self.activation_scope, ACTIVATION_SCOPES)
        check_choice("Recipe.weight_ranges", self.weight_ranges, ("minmax", "mse", "output"))
        check_choice("Recipe.reader_bounds", self.reader_bounds, (False, True, "all"))
        check_count("Recipe.distill_steps", self.distill_steps)
        check_pair_safe(self.pair_safe_weights, self.adaround, self.distill_steps)
        check_bias_correction(
            self.bias_correction,
            self.bias_correction_mask,
            self.bias_correction_check,
            self.bias_correction_shrink,
        )

    # -- resolution ---------------------------------------------------------------------------
    def for_module(
        self, module_name: str, module_type: str
    ) -> tuple[bool, TensorRecipe, TensorRecipe]:
        """(skip, weights, activations) for one layer: the last matching rule wins per field."""
        skip, weights, activations = False, self.weights, self.activations
        for rule in self.rules:
            if rule.matches(module_name, module_type):
                skip = rule.skip
                weights = rule.weights or weights
                activations = rule.activations or activations
        return skip, weights, activations

    def unmatched_rules(self, modules: list[tuple[str, str]]) -> list[Rule]:
        """Rules that match none of the given (module name, module type) pairs."""
        return [r for r in self.rules if not any(r.matches(n, t) for n, t in modules)]

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {
            "weights": self.weights.to_dict(),
            "activations": self.activations.to_dict(),
            "rules": [r.to_dict() for r in self.rules],
            "align_concat_inputs": self.align_concat_inputs,
            "align_add_inputs": self.align_add_inputs,
            "opset": self.opset,
            "quantize_constants": self.quantize_constants,
            "quantize_outputs": self.quantize_outputs,
            "equalize": self.equalize,
            "smoothquant": self.smoothquant,
            "bias_correction": self.bias_correction,
        } | ({"adaround": self.adaround.to_dict()} if self.adaround is not None else {})
        # options added later are written only when set: other recipes serialise as before
        return d | {k: getattr(self, k) for k, off in _LATER.items() if getattr(self, k) != off}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        _check_keys(
            d,
            {
                "weights",
                "activations",
                "rules",
                "align_concat_inputs",
                "align_add_inputs",
                "opset",
                "quantize_constants",
                "quantize_outputs",
                "equalize",
                "smoothquant",
                "bias_correction",
                "adaround",
                *_LATER,
            },
            "recipe",
        )
        base = cls()
        return cls(
            weights=TensorRecipe.from_dict(d["weights"], "recipe.weights")
            if "weights" in d
            else base.weights,
            activations=TensorRecipe.from_dict(d["activations"], "recipe.activations")
            if "activations" in d
            else base.activations,
            rules=tuple(
                Rule.from_dict(r, f"recipe.rules[{i}]") for i, r in enumerate(d.get("rules", []))
            ),
            align_concat_inputs=bool(d.get("align_concat_inputs", True)),
            align_add_inputs=bool(d.get("align_add_inputs", False)),
            opset=d.get("opset"),
            quantize_constants=bool(d.get("quantize_constants", True)),
            quantize_outputs=bool(d.get("quantize_outputs", True)),
            equalize=bool(d.get("equalize", False)),
            smoothquant=d.get("smoothquant"),
            bias_correction=d.get("bias_correction", False),
            adaround=AdaRound.from_value(d.get("adaround"), "recipe.adaround"),
            **{k: later_value(k, d.get(k, off), off) for k, off in _LATER.items()},
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | os.PathLike) -> Recipe:
        """A recipe from JSON text or a ``.json`` file's path."""
        return cls.from_dict(json.loads(_text_or_file(text, "JSON")))

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=True)

    @classmethod
    def from_yaml(cls, text: str | os.PathLike) -> Recipe:
        """A recipe from YAML text or a ``.yaml`` file's path (``res.write_recipe``'s file)."""
        import yaml

        return cls.from_dict(yaml.safe_load(_text_or_file(text, "YAML")))

    @classmethod
    def preset(cls, name: str) -> Recipe:
        if name == "native":
            name = native_preset()
        if name not in PRESETS:
            names = sorted([*PRESETS, "native"])
            raise ValueError(
                f"unknown recipe preset {name!r}{did_you_mean(name, names)}; presets: {names}"
            )
        return PRESETS[name]

    def with_rules(self, *rules: Rule) -> Recipe:
        return replace(self, rules=self.rules + tuple(rules))


DEFAULT = "default"  # the preset used when no recipe is given
_SYM8 = QScheme(8, True, True, False, PerTensor())
PRESETS: dict[str, Recipe] = {
    "int8": Recipe(),
    "int8_symmetric": Recipe(activations=TensorRecipe(_SYM8, "minmax")),
    "int8_avx2": Recipe(
        weights=TensorRecipe(QScheme(7, True, True, True, PerChannel(0)), "minmax")
    ),
    "w4a8": Recipe(weights=TensorRecipe(QScheme(4, True, True, True, PerChannel(0)), "minmax")),
    # AdaRound is opt-in (``adaround=None`` in every other preset), chosen by measurement
    # (2026-12-01, 2 shared cores at load 12-15): at 8-bit weights its per-layer gains on a toy
    # CNN were small (held-out reconstruction error 0.36-0.97x of nearest, the first conv never
    # improved), while it costs minutes on a ResNet-18 (300 Adam steps per layer; the bench's
    # ResNet-18 run did not finish in 20 min on this overloaded machine) against seconds of
    # calibration; at 4-bit weights it wins clearly (0.35-0.73x). ResNet-18-style (bench quick,
    # 1 thread, 100 steps/layer, on top of 7-bit + equalize + bias correction + float logits):
    # 40.05 dB vs 44.68 without, 1453 s vs 214 s at load 15-20: not in the bench's best row.
    "int8_adaround": Recipe(adaround=AdaRound()),
    # transformers (BERT-like encoders, GPT-style decoders): SmoothQuant searched per layer and
    # the outlier-carrying residual adds in float, every linear int8. MiniLM-L6, torch fake-quant,
    # 222 held-out sentences, with the weights of "native" (7-bit on this AVX2 CPU): mean cosine
    # 0.9931 (the six FFN residual adds found; "native" alone ~0.855). Swap in those weights with
    # ``dataclasses.replace(r, weights=Recipe.preset("native").weights)`` on CPUs without VNNI.
    "transformer": Recipe(smoothquant="auto", float_outlier_residuals=True),
    "pow2": Recipe(
        weights=TensorRecipe(QScheme(8, True, True, True, PerChannel(0), "pow2"), "minmax"),
        activations=TensorRecipe(QScheme(8, True, True, False, PerTensor(), "pow2"), "minmax"),
    ),
}
# The default recipe (``qb.quantize`` / ``quantize_onnx`` / ``quantbridge quantize`` without one),
# by measurement (docs/default_recipe.md). Sequential bias correction over one pass: +2.6 / +5.5
# / +3.3 dB ResNet-18 / MobileNetV2-style / OCR det, -0.023 cosine MiniLM-L6. Activations by mse
# over minmax (median of 3 calibration repeats, ORT; `python -m bench.peer_rows W [--sizes full]
# --tools quantbridge --only "default;default with mse activations" --repeats 3`): det +0.75 dB
# quick, +2.57 full (15.67 vs NNCF's 13.58: minmax's range grows with the calibration set),
# ResNet-18-style +0.49, MobileNetV2-style +0.79, MiniLM +0.031, cls +3.1 %, rec -1 of 32/128 lines.
PRESETS[DEFAULT] = replace(
    PRESETS["int8_avx2"],
    activations=replace(_default_activations(), method="mse"),
    quantize_outputs=False,
    bias_correction="sequential",
)


def native_preset() -> str:
    """The preset whose int8 file this machine's engines compute exactly: ``int8_avx2`` where
    uint8 x int8 pair sums saturate (``quantbridge._platform``), else ``int8``."""
    return "int8_avx2" if u8s8_saturates() else "int8"


_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def _text_or_file(text: str | os.PathLike, kind: str) -> str:
    """``text`` itself, or the file it names (a path: one line ending in .yaml/.yml/.json)."""
    if isinstance(text, os.PathLike) or ("\n" not in text and Path(text).suffix in _FILE_SUFFIXES):
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"recipe file {str(path)!r} not found")
        return path.read_text()
    return text


def resolve_recipe(recipe: Recipe | str | dict | None) -> Recipe:
    """Accept a Recipe, a preset name, a dict (``to_dict`` form) or None (the ``default`` preset,
    see the module docstring; ``Recipe()`` itself is the ``int8`` preset)."""
    if recipe is None:
        return PRESETS[DEFAULT]
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, (str, os.PathLike)) and Path(recipe).suffix in _FILE_SUFFIXES:
        path = Path(recipe)
        if not path.is_file():
            raise ValueError(f"recipe file {str(path)!r} not found")
        return Recipe.from_json(path) if path.suffix == ".json" else Recipe.from_yaml(path)
    if isinstance(recipe, str):
        return Recipe.preset(recipe)
    if isinstance(recipe, dict):
        return Recipe.from_dict(recipe)
    raise TypeError(
        f"recipe must be a Recipe, a preset name {sorted([*PRESETS, 'native'])}, a dict or a "
        f".yaml/.json file, got {type(recipe).__name__}"
    )
