"""The sensitivity tests' model: an MLP with one deliberately sensitive layer.

``Outlier``: four linears; ``fc2`` has one output channel about 1000x the others (weight row and
bias scaled up), which ``fc3`` does not read (its weight column is 0), so the float function is an
ordinary MLP, while one uint8 scale for ``fc2``'s output rounds every other channel of it to zero.
``norm=True`` puts a LayerNorm between ``fc1``'s ReLU and ``fc2`` (a layer whose ops all run
float: ``test_sensitivity_repairable``)."""

from __future__ import annotations

import torch
from torch import nn


class Outlier(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.norm = norm
        self.fc1 = nn.Linear(16, 32)
        if norm:
            self.ln = nn.LayerNorm(32)
        self.fc2, self.fc3, self.fc4 = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)
        with torch.no_grad():
            self.fc2.weight[0] *= 1000.0
            self.fc2.bias[0] = 1000.0
            self.fc3.weight[:, 0] = 0.0

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.norm:
            h = self.ln(h)
        h = torch.relu(self.fc2(h))
        h = torch.relu(self.fc3(h))
        return self.fc4(h)
