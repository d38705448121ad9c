"""Layers with weights that stay float are named in placement's warning (regression sweep,
2026-12-02: each was left float without a word while every Linear around it was quantized): a
recurrent layer (nn.LSTM, nn.GRU, nn.RNN: no int8 cell here), and a matmul / einsum reading a
parameter (``x @ self.proj``: the parameter is no weight to placement)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantbridge as qb


class _Recurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.emb, self.rnn, self.fc = (
            nn.Linear(8, 16),
            cell(16, 16, batch_first=True),
            nn.Linear(16, 4),
        )

    def forward(self, x):
        y, _ = self.rnn(torch.relu(self.emb(x)))
        return self.fc(y[:, -1])


def test_recurrent_layer_left_float_is_warned():
    torch.manual_seed(0)
    model, data = _Recurrent(nn.LSTM).eval(), [torch.randn(2, 5, 8)]
    with pytest.warns(UserWarning, match=r"1 layer\(s\) with weights stay float.*'rnn'.*recurrent"):
        qm = qb.quantize(model, data)
    # the float LSTM / GRU reads the int8 Linear's output: the QuantModel's result is the float
    # model's within the two quantized Linears' noise (sweep models: LSTM 49 dB, GRU 39 dB)
    with torch.no_grad():
        ref, got = model(data[0]), qm(data[0])
    assert float(((ref - got) ** 2).sum() / (ref**2).sum()) < 1e-2


class _ParameterProducts(nn.Module):
    """``h @ self.proj`` (OpenAI CLIP's projections) and ``einsum(..., self.w)``: the parameter
    is no weight to placement, the products run in float."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Parameter(torch.randn(8, 16) * 0.3)
        self.w = nn.Parameter(torch.randn(8, 4) * 0.3)

    def forward(self, x):
        h = torch.relu(self.fc(x)) @ self.proj.t()
        return torch.einsum("bd,de->be", h, self.w)


def test_product_with_a_parameter_left_float_is_warned():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"2 layer\(s\) with weights stay float.*parameter proj.*"
                      r"parameter w, .*nn.Linear"):  # fmt: skip
        qb.quantize(_ParameterProducts().eval(), [torch.randn(4, 8)])
