"""The export fast path skips torch's type-promotion pass only where that pass changes nothing.

``onnx/exporter/_promotion.promotion_needed`` reads the pass's decision from the captured dtypes;
the pass itself re-runs the whole graph on fake tensors (a quarter of a ResNet-18-style export).
Held here: on programs where it answers False the pass leaves the graph's code unchanged; on
programs needing casts it answers True; and the exported file is the same byte for byte as with
the pass forced.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import quantbridge as qb
from quantbridge.onnx.exporter import _torch_onnx
from quantbridge.onnx.exporter._promotion import promotion_needed

_fx_passes = pytest.importorskip("torch.onnx._internal.exporter._fx_passes")


class _Conv(nn.Module):  # float tensors and float scalars only: nothing to promote
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 2)

    def forward(self, x):
        y = torch.relu(self.conv(x)) * 0.5 + 1.0
        return self.fc(y.mean((2, 3)) / 3.0)


class _IntScalar(nn.Module):  # ``x / 3``: the pass makes the int 3 a float32 scalar tensor
    def forward(self, x):
        return torch.relu(x) / 3


class _IntTimesFloat(nn.Module):  # int64 arange times a float tensor: a cast is inserted
    def forward(self, x):
        return x * torch.arange(x.shape[-1]) + 2


class _BoolMask(nn.Module):  # a bool mask added to float, an int sum divided: casts
    def forward(self, x, mask):
        return (x + mask) / mask.sum(-1, keepdim=True)


CASES = [
    (_Conv, (torch.randn(2, 3, 8, 8),), False),
    (_IntScalar, (torch.randn(2, 5),), True),
    (_IntTimesFloat, (torch.randn(2, 5),), True),
    (_BoolMask, (torch.randn(2, 5), torch.rand(2, 5) > 0.5), True),
]


@pytest.mark.parametrize(
    ("make", "args", "needed"), CASES, ids=lambda c: getattr(c, "__name__", "")
)
def test_promotion_needed_is_the_pass_s_own_decision(make, args, needed):
    program = torch.export.export(make().eval(), args, strict=False)
    gm = program.graph_module
    before = gm.code
    assert promotion_needed(gm) is needed
    promoted = copy.deepcopy(gm)
    _fx_passes.insert_type_promotion_nodes(promoted)
    promoted.recompile()
    # False exactly when the pass leaves the graph as it was
    assert (promoted.code == before) is (not needed)


def _export_bytes(qmodel, path, example) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qb.export(qmodel, path, example_inputs=example)
    return path.read_bytes()


def test_skipping_the_pass_writes_the_same_file(tmp_path, monkeypatch):
    torch.manual_seed(0)
    calib = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    qmodel = qb.quantize(_Conv().eval(), calib, progress=False)
    decided = []
    monkeypatch.setattr(
        _torch_onnx, "promotion_needed", lambda gm: decided.append(promotion_needed(gm)) or False
    )
    skipped = _export_bytes(qmodel, tmp_path / "skip.onnx", calib[0][:1])
    assert decided == [False]  # the fast path asked, and the real answer was "skip"
    monkeypatch.setattr(_torch_onnx, "promotion_needed", lambda gm: True)
    forced = _export_bytes(qmodel, tmp_path / "pass.onnx", calib[0][:1])
    assert skipped == forced
