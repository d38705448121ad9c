"""A layer called more than once (ALBERT's shared layers, a block applied in a loop, a siamese
encoder) under the default preset's sequential bias correction. Its parameter is read by one
quantizer per call; placement writes the second call's quantizer before the first's, and the
walk that runs each quantizer just before its layer (``_graph.late_constants``) freed the
parameter after the first quantizer in graph order: ``qb.quantize`` raised torch.fx's
"Node _quantbridge_fc_bias_2 referenced nonexistent value fc_bias" (HF ALBERT, 2026-12-02)."""

from __future__ import annotations

import torch
from torch import nn

import quantbridge as qb
from quantbridge.torch.ptq import _graph


class _SharedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.inp, self.fc, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        with torch.no_grad():
            for m in (self.inp, self.fc, self.out):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.3)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
        self.eval()

    def forward(self, x):
        h = self.inp(x)
        for _ in range(2):
            h = h + torch.relu(self.fc(h))
        return self.out(h)


def test_a_layer_called_twice_is_quantized_and_bias_corrected():
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(16, 8, generator=g) for _ in range(3)]
    model = _SharedBlock()
    q = qb.quantize(model, data, progress=False)
    # the walk frees each value after its last reader in the order it runs the nodes
    order = _graph.late_constants(q.graph)
    position = {node: i for i, node in enumerate(order)}
    for reader, values in _graph.last_readers(order).items():
        for value in values:
            assert all(position[u] <= position[reader] for u in value.users if u in position)
    x = torch.randn(64, 8, generator=g)
    with torch.no_grad():
        ref, got = model(x), q(x)
    # 8-bit weights and activations, four linear calls: measured 24.4 dB; a layer left float
    # would be far above it, a bias corrected with another call's values far below
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum())
    assert 21 < sqnr < 40
