"""A float op reading a graph input that a layer quantizes reads it on that grid too (issue 10:
integer-only lowering of pre-norm encoders, whose first LayerNorm reads the input that the
residual add quantizes; before, that LayerNorm read the raw float input and ``qb.lower``
refused it). One quantizer serves both readers, so the QDQ file has the same Q/DQ count;
bench.attention's pre-norm encoder measured the same in ORT (docs/attention.md). A recipe rule
that skips the float op's module keeps it reading the float input."""

from __future__ import annotations

import torch
from torch import nn

import quantbridge as qb


class PreNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(self.norm(x))


def _readers_of_input(qmodel) -> dict[str, object]:
    """{op name: what it reads for the graph input (a quantizer's target or 'float')}"""
    (x,) = [n for n in qmodel.graph.nodes if n.op == "placeholder"]
    found = {}
    for q in x.users:
        if q.op == "call_module":
            for user in q.users:
                found[str(user.target)] = q.target
        else:
            found[str(q.target)] = "float"
    return found


def _quantized(recipe="int8"):
    torch.manual_seed(0)
    data = [torch.randn(2, 4, 16) for _ in range(2)]
    return qb.quantize(PreNorm().eval(), data, recipe=recipe, progress=False), data[0]


def test_layer_norm_reads_the_input_on_the_residual_add_grid():
    qmodel, _ = _quantized()
    readers = _readers_of_input(qmodel)
    norm = [v for k, v in readers.items() if "layer_norm" in k]
    add = [v for k, v in readers.items() if "add" in k]
    assert len(norm) == 1 and norm == add and norm[0] != "float"  # one quantizer, both readers


def test_a_skipped_float_op_keeps_the_float_input(recwarn):
    recipe = qb.Recipe(rules=(qb.Rule(pattern="norm", skip=True),))
    qmodel, _ = _quantized(recipe)
    readers = _readers_of_input(qmodel)
    assert [v for k, v in readers.items() if "layer_norm" in k] == ["float"]
    assert [v for k, v in readers.items() if "add" in k] != ["float"]
    assert not [w for w in recwarn if "matches no layer" in str(w.message)]  # the rule matched
