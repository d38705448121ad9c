"""Layers with weights that stay float are named in placement's warning (regression sweep,
2026-12-02: each was left float without a word while every Linear around it was quantized): a
recurrent layer (nn.LSTM, nn.GRU, nn.RNN: no int8 cell here), and a matmul / einsum reading a
parameter (``x @ self.proj``: the parameter is no weight to placement). The recurrent case is
asserted in ``tests/onnx/test_import_recurrent.py`` (the CRNN quantized there, then exported and
imported back: one quantize for both)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantbridge as qb


class _ParameterProducts(nn.Module):
    """``h @ self.proj`` (OpenAI CLIP's projections) and ``einsum(..., self.w)``: the parameter
    is no weight to placement, the products run in float. (``h @ self.proj.t()`` is a linear
    layer: ``_linear_products``.)"""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Parameter(torch.randn(16, 8) * 0.3)
        self.w = nn.Parameter(torch.randn(8, 4) * 0.3)

    def forward(self, x):
        h = torch.relu(self.fc(x)) @ self.proj
        return torch.einsum("bd,de->be", h, self.w)


def test_product_with_a_parameter_left_float_is_warned():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"2 layer\(s\) with weights stay float.*parameter proj.*"
                      r"parameter w, .*nn.Linear"):  # fmt: skip
        qb.quantize(_ParameterProducts().eval(), [torch.randn(4, 8)])


class _Bfloat16Bias(nn.Module):
    """HF Falcon's ALiBi: ``slopes.bfloat16() * positions`` inside a float32 model, then
    ``.to(float32)`` and added to float32 scores."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        positions = x.abs().sum(-1, keepdim=True).bfloat16()
        bias = torch.tensor(0.5).bfloat16() * positions
        return self.fc(x) + bias.float()


def test_tensors_of_other_float_dtypes_stay_float():
    """Only float32 tensors get quantizers: the bfloat16 product stays bfloat16 and float (ONNX
    Runtime has no QuantizeLinear of bfloat16). Before: a quantizer (float32 out) on it, and
    torch's own dtype check in the captured graph failed at the first call ('Tensor dtype
    mismatch! Expected: BFloat16, Got: float'). The float32 linear and add stay quantized."""
    torch.manual_seed(0)
    model = _Bfloat16Bias().eval()
    batches = [torch.randn(4, 8) for _ in range(2)]
    qm = qb.quantize(model, batches, progress=False)
    x = batches[0]  # within the calibrated ranges: no clipping
    ref, y = model(x), qm(x)
    # int8 noise only: the result's step is ~max|ref| / 255, the input and weight steps add a
    # few of it (measured: 0.5% of max|ref|); a bias left out (up to 5 here) would be far off
    assert (y - ref).abs().max() < 0.05 * ref.abs().max()
    assert any(name.endswith("fc.weight") for name in qm.quantizers())


class _Experts(nn.Module):
    """HF mixture-of-experts with ``experts_implementation='batched_mm'``: each token's expert
    weight picked by index from a 3-D parameter, then ``bmm``."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.w = nn.Parameter(torch.randn(4, 8, 8) * 0.3)

    def forward(self, x):
        ids = self.router(x).argmax(-1)
        return torch.bmm(x.unsqueeze(1), self.w[ids].transpose(1, 2)).squeeze(1)


def test_expert_weights_picked_by_index_are_quantized_not_named_as_float():
    """Session 13: named as float (before, float without a word); now quantized per (expert,
    output channel) (``tests/torch/test_moe_experts.py``), and no longer in the warning."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "stay float" warning
        qm = qb.quantize(_Experts().eval(), [torch.randn(6, 8)], progress=False)
    assert qm.quantizers()["w"].kind == "weight"
