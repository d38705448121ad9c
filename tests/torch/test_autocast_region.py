"""A ``with torch.autocast(..., enabled=False):`` block inside ``forward`` (timm's EfficientViT
linear attention): ``torch.export`` keeps it as a ``wrap_with_autocast`` call of a sub-graph,
which the placement did not look into, so its matmuls stayed float without a word
(``efficientvit_b0``: 8 of 60 matmuls). The block is inlined at capture (``_autocast``)."""

from __future__ import annotations

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch import nn

import quantbridge as qb


class _LinearAttention(nn.Module):
    """EfficientViT's LiteMLA in miniature: ReLU kernels, k^T v, q (k^T v), normalised."""

    def __init__(self, autocast_off: bool):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)
        self.autocast_off = autocast_off

    def _attn(self, q, k, v):
        kv = k.transpose(-1, -2) @ v
        return q @ kv

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = F.relu(q), F.relu(k)
        if self.autocast_off:
            with torch.autocast(device_type=x.device.type, enabled=False):
                out = self._attn(q, k, v)
        else:
            out = self._attn(q, k, v)
        return self.proj(out)


def _quantized(autocast_off: bool):
    torch.manual_seed(0)
    model = _LinearAttention(autocast_off).eval()
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(1, 8, 16, generator=g) for _ in range(4)]
    return model, qb.quantize(model, data), data


def test_ops_in_an_autocast_off_block_are_quantized_like_inline_ones(tmp_path):
    model, q, data = _quantized(autocast_off=True)
    _, q_inline, _ = _quantized(autocast_off=False)  # the same weights, the block written inline
    x = data[0]
    with torch.no_grad():
        # the reference: the same model without the block; the same placement gives the same
        # quantizers, so the int8 outputs agree to float32 rounding, not just within a step
        assert torch.allclose(q(x), q_inline(x), rtol=0, atol=1e-6)
        assert not torch.equal(q(x), model(x))  # the premise: quantized, not the float model
    path = tmp_path / "attn.onnx"
    qb.export(q, path, x)
    graph = onnx.load(str(path)).graph
    producer = {o: n.op_type for n in graph.node for o in n.output}
    matmuls = [n for n in graph.node if n.op_type == "MatMul"]
    activation_products = [
        n for n in matmuls if all(producer.get(i) == "DequantizeLinear" for i in n.input)
    ]
    assert len(activation_products) == 2, [[producer.get(i) for i in n.input] for n in matmuls]
    assert not [n for n in graph.node if n.domain == "" and "autocast" in n.op_type.lower()]
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    (y,) = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(
        None, {graph.input[0].name: x.numpy()}
    )
    with torch.no_grad():
        ref = q(x).numpy()
    # unfused ORT computes the same float ops as fake-quant: float32 rounding apart
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
