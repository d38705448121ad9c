"""Constant affine maps after a conv / linear fold into its weight and bias (``_fold_affine``).

The float function must stay the same to float32 rounding (compared against the unfolded graph),
the folded ops must lose their quantizers, and what cannot fold (a trained scale, a constant that
varies over space or batch, a layer output read twice) must stay as captured.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx import numpy_helper as nh
from torch import nn

import quantbridge as qb
from quantbridge.torch._capture import capture
from quantbridge.torch._fold_affine import fold_affine
from quantbridge.torch._fold_affine_input import fold_affine_inputs
from quantbridge.torch._quantizer import Quantizer

aten = torch.ops.aten
AFFINE = {aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor}


class ConvAffine(nn.Module):
    """conv -> * s -> + t (PP-LCNetV3's affine block), then a per-channel layer scale."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 1, bias=False)
        self.register_buffer("gamma", torch.linspace(-2, 3, 8).reshape(8, 1, 1))
        self.register_buffer("beta", torch.linspace(1, -1, 8).reshape(1, 8, 1, 1))

    def forward(self, x):
        y = torch.relu(self.conv(x) * 1.9 + 0.8)
        return 0.5 + self.gamma * self.conv2(y) - self.beta  # either order, shift first


class LinearAffine(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.register_buffer("scale", torch.tensor([1.0, -2.0, 0.5, 3.0]))

    def forward(self, x):
        return torch.relu((self.fc(x) - 0.25) * self.scale / 4.0)


def _affine_ops(gm) -> int:
    return sum(n.op == "call_function" and n.target in AFFINE for n in gm.graph.nodes)


@pytest.mark.parametrize(
    ("model", "shape", "ops"),
    [(ConvAffine(), (2, 3, 8, 8), 5), (LinearAffine(), (2, 5, 16), 3)],
    ids=["conv", "linear"],
)
def test_affine_folds_and_the_float_function_is_unchanged(model, shape, ops):
    torch.manual_seed(0)
    x = torch.randn(shape)
    gm = capture(model.eval(), (x,), {}, "batch")
    before = gm(x)[0] if isinstance(gm(x), tuple) else gm(x)
    assert _affine_ops(gm) == ops
    assert fold_affine(gm) == ops
    assert _affine_ops(gm) == 0
    after = gm(x)[0] if isinstance(gm(x), tuple) else gm(x)
    # float32 rounding: the fold multiplies in float64 then rounds W and b once each, so the
    # outputs differ by a few float32 ulps of the largest magnitude in the sums
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5 * before.abs().max().item())
    assert torch.equal(model(x), before)  # the user's model keeps its own weights


class AffineIntoLayers(nn.Module):
    """Constant affines a layer reads: PP-LCNetV3's ``hardswish -> * s -> + t -> 1x1 conv``, an
    input normalisation before a padded conv (its scale folds, its shift cannot), a per-channel
    affine before a grouped conv, a per-feature shift before a linear."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(4, 6, 3, padding=1)
        self.pw = nn.Conv2d(6, 6, 1)
        self.grouped = nn.Conv2d(6, 4, 3, groups=2, bias=False)
        self.fc = nn.Linear(4, 3)
        self.register_buffer("mean", torch.tensor([0.5, -1.0, 2.0, 0.0]).reshape(1, 4, 1, 1))
        self.register_buffer("std", torch.tensor([0.2, 2.0, 1.5, 0.7]).reshape(4, 1, 1))
        self.register_buffer("k", torch.linspace(-1.5, 2.0, 6).reshape(6, 1, 1))
        self.register_buffer("t", torch.linspace(1.0, -0.5, 4))

    def forward(self, x):
        y = self.stem((x - self.mean) / self.std)
        y = self.pw(nn.functional.hardswish(y) * 0.47 - 0.0076)
        y = self.grouped(self.k * torch.relu(y) + 0.3)
        return self.fc(y.mean((2, 3)) + self.t)


def test_affine_a_layer_reads_folds_and_the_float_function_is_unchanged():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 9, 9)
    model = AffineIntoLayers().eval()
    gm = capture(model, (x,), {}, "batch")
    before = gm(x)
    assert fold_affine(gm) == 0
    assert fold_affine_inputs(gm) == 6  # all but the shift before the padded stem
    assert _affine_ops(gm) == 1
    (sub,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in AFFINE]
    assert sub.target is aten.sub.Tensor  # (x - mean) stays: the stem's border reads zeros
    torch.testing.assert_close(gm(x), before, rtol=1e-5, atol=1e-5 * before.abs().max().item())


class NotFoldable(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 1)
        self.c = nn.Conv2d(3, 4, 1)
        self.trained = nn.Parameter(torch.tensor(2.0))  # learns: folding would freeze it
        self.register_buffer("spatial", torch.rand(1, 1, 8, 8))  # varies over space

    def forward(self, x):
        a = self.a(x)
        return self.trained * self.b(x) + self.c(x) * self.spatial + a * 2.0 + a


def test_trained_spatial_and_shared_outputs_are_left_alone():
    x = torch.randn(2, 3, 8, 8)
    gm = capture(NotFoldable().eval(), (x,), {}, "batch")
    assert fold_affine(gm) == 0


def _onnx_conv_affine() -> onnx.ModelProto:
    """Paddle2ONNX's form of the block: Mul(scalar const, conv) -> Add(., scalar const)."""
    r = np.random.default_rng(0)
    init = [
        nh.from_array(r.standard_normal((8, 3, 3, 3)).astype(np.float32), "W"),
        nh.from_array(r.standard_normal(8).astype(np.float32), "B"),
        nh.from_array(np.array([1.9], np.float32), "s"),
        nh.from_array(np.array([0.8], np.float32), "t"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Mul", ["s", "c"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "t"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])],
        init,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def test_imported_onnx_affine_folds_and_loses_its_quantizers(tmp_path):
    torch.manual_seed(0)
    module = qb.import_onnx(_onnx_conv_affine())
    calib = [torch.randn(2, 3, 8, 8) for _ in range(4)]
    recipe = replace(qb.Recipe.preset("int8"), fold_affine=True)
    plain = qb.quantize(module, calib, recipe="int8", progress=False)  # off unless asked for
    assert sum(type(m) is Quantizer for m in plain.modules()) == 4
    q = qb.quantize(module, calib, recipe=recipe, progress=False)
    names = sorted(m.name for m in q.modules() if type(m) is Quantizer)
    assert names == ["conv/conv2d", "input/x"], names  # no quantizer left on the mul or add
    x = torch.randn(3, 3, 8, 8)
    with qb.float_mode(q), torch.no_grad():
        folded = q(x)
    torch.testing.assert_close(folded, module(x), rtol=1e-5, atol=1e-5)
    qb.save(q, tmp_path / "q.pt")  # the recipe is saved: the fold is replayed
    again = qb.load(tmp_path / "q.pt", qb.import_onnx(_onnx_conv_affine()))
    assert torch.equal(again(x), q(x))
