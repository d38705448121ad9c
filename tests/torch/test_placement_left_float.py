"""Layers with weights that stay float are named in placement's warning (regression sweep,
2026-12-02: each was left float without a word while every Linear around it was quantized): a
recurrent layer (nn.LSTM, nn.GRU, nn.RNN: no int8 cell here), and a matmul / einsum reading a
parameter (``x @ self.proj``: the parameter is no weight to placement). The recurrent case is
asserted in ``tests/onnx/test_import_recurrent.py`` (the CRNN quantized there, then exported and
imported back: one quantize for both)."""

from __future__ import annotations

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
