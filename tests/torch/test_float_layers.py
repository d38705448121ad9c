"""Layers whose weights run in float are named with their reason by ``QuantModel.float_layers``
and ``summary`` (``torch/_float_layers``). Before: a layer a recipe rule skipped ran in float
without a word (placement's "stay float" warning names only layers no rule skips, and
``summary`` listed quantizers only)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import quantbridge as qb


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.c = nn.Conv1d(8, 8, 1)
        self.proj = nn.Parameter(torch.randn(8, 4) * 0.3)  # ``h @ self.proj``: no int8 form

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        return self.c(h.unsqueeze(-1)).squeeze(-1) @ self.proj


def _quantize(recipe):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the matmul's "stay float" warning: its own tests
        return qb.quantize(_Mixed().eval(), [torch.randn(4, 8)], recipe=recipe, progress=False)


def test_rule_skipped_and_unquantizable_layers_are_named():
    qm = _quantize(qb.Recipe().with_rules(qb.Rule(pattern="b", skip=True)))
    found = qm.float_layers()
    assert set(found) == {"b", "matmul"}  # a and c are int8
    assert found["b"] == "kept float by the recipe rule (pattern='b', skip=True)"
    assert "parameter proj" in found["matmul"]
    summary = qm.summary().splitlines()
    assert "b: float weight, kept float by the recipe rule (pattern='b', skip=True)" in summary
    # the quantized layers' weights have quantizers, and are not listed as float
    assert "a.weight" in qm.quantizers() and "c.weight" in qm.quantizers()


def test_type_rule_and_nothing_float():
    qm = _quantize(qb.Recipe().with_rules(qb.Rule(module_type="Conv1d", skip=True)))
    assert qm.float_layers()["c"] == (
        "kept float by the recipe rule (module_type='Conv1d', skip=True)"
    )
    torch.manual_seed(0)
    plain = qb.quantize(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval(),
                        [torch.randn(4, 8)], progress=False)  # fmt: skip
    assert plain.float_layers() == {}
    assert "float weight" not in plain.summary()
