"""Layers whose weights run in float are named with their reason by ``QuantModel.float_layers``
and ``summary`` (``torch/_float_layers``). Before: a layer a recipe rule skipped ran in float
without a word (placement's "stay float" warning names only layers no rule skips, and
``summary`` listed quantizers only)."""

from __future__ import annotations

import warnings

import pytest
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


@torch.library.custom_op("qbtest::expert_mm", mutates_args=())
def _expert_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.transpose(-2, -1).sum(0)


@_expert_mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


class _Experts(nn.Module):
    """Two reads of stacked parameters by an op of another library in one layer, as Hugging
    Face mixture-of-experts run ``transformers.grouped_mm_fallback`` (gate_up_proj, down_proj)
    by default."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, 8) * 0.3)
        self.w2 = nn.Parameter(torch.randn(3, 8, 4) * 0.3)

    def forward(self, x):
        return torch.ops.qbtest.expert_mm(torch.ops.qbtest.expert_mm(x, self.w), self.w2)


class _LibraryOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.experts = nn.Linear(8, 8), _Experts()

    def forward(self, x):
        return self.experts(self.fc(x))


def test_op_of_another_library_reading_a_parameter_is_warned_and_listed():
    """Before: quantize said nothing (``warned: []`` for Mixtral in bench/hf_sweep), its
    experts' weights float; export then failed on the op."""
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"1 layer\(s\) with weights stay float.*'experts': qbtest::"
                      r"expert_mm reads the parameter experts.w, experts.w2:"):  # fmt: skip
        qm = qb.quantize(_LibraryOp().eval(), [torch.randn(4, 8)], progress=False)
    found = qm.float_layers()
    assert list(found) == ["experts"]
    assert "qbtest::expert_mm reads the parameter experts.w" in found["experts"]
    # a rule that skips the layer silences the warning, and ``float_layers`` names the rule
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*stay float")
        qm = qb.quantize(_LibraryOp().eval(), [torch.randn(4, 8)], progress=False,
                         recipe=qb.Recipe().with_rules(qb.Rule(pattern="*", skip=True)))  # fmt: skip
    assert qm.float_layers()["experts"] == "kept float by the recipe rule (pattern='*', skip=True)"
