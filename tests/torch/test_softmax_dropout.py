"""A dropout between a softmax and the attention matmul does not give the probabilities a
quantizer (issue 12, part 8; regression).

The softmax output stays float by design (``_ops.KEEP_FLOAT_OUTPUT_OPS``: ONNX Runtime's
QLinearSoftmax is off by one code on many elements). BERT's eager attention writes
``softmax -> dropout -> matmul`` and Llama's ``softmax -> to(float32) -> dropout -> matmul``; the
dropout (the identity in eval) used to hide the softmax, so its output got a QuantizeLinear that
``softmax -> matmul`` does not get. Both forms must now place the same quantizers and export the
same float attention-times-values MatMul.
"""

from __future__ import annotations

import collections

import onnx
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.onnx.inspector import inspect_model


class _Attention(nn.Module):
    def __init__(self, between: str):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)
        self.between = between

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) * 0.25
        p = torch.softmax(scores, -1)
        if self.between == "dropout":
            p = self.drop(p)
        elif self.between == "cast+dropout":
            p = self.drop(p.to(torch.float32))
        return p @ self.v(x)


def _quantized(between: str):
    torch.manual_seed(0)
    batches = [torch.randn(2, 5, 16) for _ in range(2)]
    return qb.quantize(_Attention(between).eval(), batches, progress=False, recipe="int8"), batches[
        0
    ]


def _matmul_inputs(qmodel) -> list[tuple[str, str]]:
    """For each matmul: what its two inputs are (a quantizer call, or the op producing them)."""
    found = []
    for n in qmodel.graph.nodes:
        if n.target is torch.ops.aten.matmul.default:
            found.append(tuple("quantizer" if a.op == "call_module" else a.name for a in n.args))
    return found


@pytest.mark.parametrize("between", ["dropout", "cast+dropout"])
def test_dropout_after_softmax_places_what_plain_softmax_places(between, tmp_path):
    plain, example = _quantized("nothing")
    dropped, _ = _quantized(between)
    assert len(plain.quantizers()) == len(dropped.quantizers())
    first, second = _matmul_inputs(dropped)
    assert first == ("quantizer", "quantizer")  # q @ k^T: both on a grid
    assert second[0] != "quantizer" and second[1] == "quantizer"  # probabilities stay float
    assert _matmul_inputs(plain)[1][0] != "quantizer"
    # in the export: the same Q/DQ counts; int8 MatMuls: the 3 projections and q @ k^T; float:
    # the probabilities times v
    counts = {}
    for name, qmodel in (("plain", plain), ("dropped", dropped)):
        path = tmp_path / f"{name}.onnx"
        qb.export(qmodel, path, example_inputs=example)
        ops = collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)
        report = inspect_model(path)
        counts[name] = (ops["QuantizeLinear"], ops["DequantizeLinear"])
        assert report.float_ops.get("MatMul") == 1 and report.int8_ops.get("MatMul") == 4
    assert counts["plain"] == counts["dropped"]
