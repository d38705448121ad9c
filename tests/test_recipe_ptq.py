"""The Recipe fields of the post-training methods (``torch.ptq``): round trip and validation."""

from __future__ import annotations

import dataclasses

import pytest

import quantbridge as qb


@pytest.mark.parametrize("smoothquant", [None, "auto", 0.0, 0.5, 1.0])
def test_round_trip(smoothquant):
    r = dataclasses.replace(
        qb.Recipe.preset("int8"), equalize=True, bias_correction=True, smoothquant=smoothquant
    )
    assert qb.Recipe.from_dict(r.to_dict()) == r
    assert qb.Recipe.from_json(r.to_json()) == r
    assert qb.Recipe.from_yaml(r.to_yaml()) == r


def test_defaults_off_and_old_dicts_load():
    r = qb.Recipe()
    assert (r.equalize, r.bias_correction, r.smoothquant) == (False, False, None)
    d = r.to_dict()
    for key in ("equalize", "bias_correction", "smoothquant"):
        d.pop(key)  # a recipe written before these fields existed
    assert qb.Recipe.from_dict(d) == r


def test_integer_alpha_is_a_float():
    assert qb.Recipe.from_dict({"smoothquant": 1}).smoothquant == 1.0


@pytest.mark.parametrize("bad", [1.5, -0.1, "max", True, [0.5]])
def test_bad_smoothquant_names_the_fix(bad):
    with pytest.raises(ValueError, match="smoothquant.*alpha in \\[0, 1\\], 'auto'"):
        qb.Recipe(smoothquant=bad)


def test_bias_correction_variants():
    for value in (False, True, "sequential"):
        r = qb.Recipe(bias_correction=value)
        assert qb.Recipe.from_yaml(r.to_yaml()) == r
    with pytest.raises(ValueError, match="bias_correction='fast'.*'sequential'"):
        qb.Recipe(bias_correction="fast")
