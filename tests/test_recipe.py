"""Recipes are plain data: dict / JSON / YAML round trips, validation naming the key."""

from __future__ import annotations

import inspect

import pytest

import quantbridge as qb
from quantbridge.recipe import PRESETS, Recipe, resolve_recipe


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_dict_json_yaml(name):
    r = Recipe.preset(name)
    assert Recipe.from_dict(r.to_dict()) == r
    assert Recipe.from_json(r.to_json()) == r
    assert Recipe.from_yaml(r.to_yaml()) == r


def test_recipe_with_rules_round_trips():
    w4 = qb.TensorRecipe(qb.QScheme(4, True, True, True, qb.PerChannel(0)), "minmax")
    act = qb.TensorRecipe(qb.QScheme(8, False, False), "percentile", (("percentile", 99.9),))
    r = Recipe(activations=act, opset=21).with_rules(
        qb.Rule(pattern="layer4.*", skip=True), qb.Rule(module_type="Linear", weights=w4)
    )
    assert Recipe.from_json(r.to_json()) == r
    assert Recipe.from_yaml(r.to_yaml()) == r


def test_default_recipe_is_the_measured_default_preset():
    """What qb.quantize / quantize_onnx / `quantbridge quantize` use without a recipe (chosen by
    measurement, quantbridge.recipe): 7-bit per-channel weights on every CPU, uint8 activations
    (mse), float graph outputs and bias correction (no equalization). ``Recipe()``
    itself stays the plain ``int8`` preset."""
    r = resolve_recipe(None)
    assert r == Recipe.preset("default") == resolve_recipe("default")
    assert (r.weights.scheme.qmin, r.weights.scheme.qmax) == (-63, 63)
    assert (r.activations.scheme.qmin, r.activations.scheme.qmax) == (0, 255)
    assert r.activations.method == "mse"  # session 15 (docs/default_recipe.md)
    assert (r.quantize_outputs, r.equalize, r.bias_correction) == (False, False, "sequential")
    assert Recipe() == Recipe.preset("int8")
    assert (Recipe().weights.scheme.qmin, Recipe().quantize_outputs) == (-127, True)
    for fn in (qb.quantize, qb.quantize_onnx):
        assert inspect.signature(fn).parameters["recipe"].default == "default"


@pytest.mark.parametrize(
    "d, message",
    [
        ({"wieghts": {}}, "unknown key 'wieghts' in recipe"),
        ({"weights": {"schema": {}}}, "unknown key 'schema' in recipe.weights"),
        ({"rules": [{"pattern": "a", "skipp": True}]}, r"unknown key 'skipp' in recipe.rules\[0\]"),
        ({"weights": {"scheme": {"bits": 1}}}, r"bits=1.*2..16"),
        ({"activations": {"method": "kl"}}, "calibration method 'kl' is unknown"),
        ({"rules": [{"skip": True}]}, "needs a 'pattern'"),
        ({"opset": 11}, "opset=11"),
        (
            {"activations": {"scheme": {"granularity": {"kind": "per_channel", "axis": 1}}}},
            "per-channel activation",
        ),
    ],
)
def test_bad_recipes_name_the_key(d, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Recipe.from_dict(d)


def test_skip_with_override_is_contradictory():
    w = qb.TensorRecipe(qb.QScheme())
    with pytest.raises(ValueError, match="contradictory"):
        qb.Rule(pattern="x", skip=True, weights=w)


def test_last_matching_rule_wins():
    w4 = qb.TensorRecipe(qb.QScheme(4, True, True, True, qb.PerChannel(0)))
    r = Recipe().with_rules(
        qb.Rule(pattern="layer*", skip=True), qb.Rule(pattern="layer1.*", weights=w4)
    )
    skip, weights, _ = r.for_module("layer1.0.conv1", "Conv2d")
    assert skip is False and weights.scheme.bits == 4
    assert r.for_module("layer2.0.conv1", "Conv2d")[0] is True
