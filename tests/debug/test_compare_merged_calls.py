"""compare's torch-quant pairs quantizer calls the ONNX optimizer merged into one tensor, by the
export record's ``"sites"`` (Llama exported with ``dynamic="all"``: four rotary
``cos.unsqueeze(1)`` calls in three tensors left 6 of 133 tensors unmatched)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.debug._match import QUANTIZERS_KEY, Site
from quantbridge.debug._match_torch import recorded_calls


def _site(name: str, order: int) -> Site:
    return Site(name, order, "Unsqueeze", name, 0.01, 0, onnx.TensorProto.INT8)


def test_recorded_calls_pair_each_call_with_its_tensor():
    # two quantizers whose calls the optimizer merged into "q0", a shared one called twice
    sites = [_site("q0", 0), _site("q2", 1), _site("q3", 2)]
    points = [SimpleNamespace(name=n, attr=a, kind="activation")
              for n, a in (("b0/u", "b0_u"), ("b1/u", "b1_u"), ("s", "s"))]  # fmt: skip
    record = {"b0/u": {"sites": ["q0"]}, "b1/u": {"sites": ["q0"]}, "s": {"sites": ["q2", "q3"]}}
    model = onnx.ModelProto()
    onnx.helper.set_model_props(model, {QUANTIZERS_KEY: json.dumps(record)})
    assert recorded_calls(sites, points, model) == {
        "q0": (("b0_u",), 0), "q2": (("s",), 0), "q3": (("s",), 1),
    }  # fmt: skip


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, h, cos):
        return self.l(h) * cos.unsqueeze(1) + h


class _Rotaryish(nn.Module):
    """cos of the input, unsqueezed in each block (Llama's apply_rotary_pos_emb): both blocks'
    unsqueeze quantizers calibrate the same values, the exporter merges them into one tensor."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        cos = torch.cos(x.mean(1))
        h = self.a(x)
        for blk in self.b:
            h = blk(h, cos)
        return h


@pytest.mark.slow  # a capture and an export: ~10 s on a loaded 2-core machine
def test_merged_quantizer_calls_are_paired():
    torch.manual_seed(0)
    xs = [torch.randn(2, 4, 8) for _ in range(2)]
    q = qb.quantize(_Rotaryish().eval(), xs)
    r = qb.compare(q, inputs=xs[0].numpy(), engines=["ort-ref", "torch-quant"])
    assert r.errors == {}
    assert r.unmatched == {}  # was {'torch-quant': ['val_10']}: the merged unsqueeze tensor
    assert r.first_divergence is None
    merged = [t for t in r.tensors if t["op"] == "Unsqueeze"]
    assert len(merged) == 1  # the premise: two calls, one tensor
    (pair,) = merged[0]["pairs"]
    assert pair["max_lsb"] <= 1 and np.isfinite(pair["sqnr_db"])


def test_recorded_calls_keep_the_places_of_the_calls_left_without_a_tensor():
    # a shared grid called three times; the optimizer removed the second call's node (a no-op
    # slice) with no survivor: the first and third still pair with their own calls
    sites = [_site("q0", 0), _site("q2", 1)]
    points = [SimpleNamespace(name="g", attr="g", kind="activation")]
    model = onnx.ModelProto()
    onnx.helper.set_model_props(
        model, {QUANTIZERS_KEY: json.dumps({"g": {"sites": ["q0", "", "q2"]}})}
    )
    assert recorded_calls(sites, points, model) == {"q0": (("g",), 0), "q2": (("g",), 2)}


class _ClassTokenFusion(nn.Module):
    """CrossViT's branch fusion: a class token concatenated to the tokens, its slice projected,
    concatenated to the other branch's patch tokens, and back. The concats put the class token,
    its projection and the tokens on one grid, whose quantizer runs at every slice; the ONNX
    optimizer removes the no-op full slices ``x[:, ...]`` and their QuantizeLinear, which left
    the whole grid without a recorded site and 7 of its tensors unmatched (42 in
    crossvit_tiny_240, where the unpaired slice hid the carried error of the next layer norm and
    compare named it a false first divergence of 22 steps)."""

    def __init__(self, d=8):
        super().__init__()
        self.embed = nn.Linear(3, d)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.proj = nn.Sequential(nn.LayerNorm(d), nn.GELU(), nn.Linear(d, d))
        self.fuse = nn.Linear(d, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        t = torch.cat((self.cls.expand(x.shape[0], -1, -1), self.embed(x)), 1)
        c = self.proj(t[:, 0:1, ...])
        t = self.fuse(torch.cat((c, t[:, 1:, ...]), 1))
        return self.head(t[:, 0])


@pytest.mark.slow  # a capture and an export: ~20 s on a loaded 2-core machine
def test_class_token_slices_of_a_shared_grid_are_paired():
    torch.manual_seed(0)
    xs = [torch.randn(2, 6, 3) for _ in range(2)]
    q = qb.quantize(_ClassTokenFusion().eval(), xs)
    r = qb.compare(q, inputs=xs[0].numpy(), engines=["ort-ref", "torch-quant"])
    assert r.errors == {}
    assert r.unmatched == {}  # was 'Slice ...', 'Concat ...' tensors of the shared grid
    assert r.first_divergence is None
    slices = [t for t in r.tensors if t["op"] == "Slice"]
    assert slices  # the premise: requantized slices in the file
    for t in slices:
        (pair,) = t["pairs"]
        assert pair["max_lsb"] <= 1  # same integers: only float64 rounding of the codes
