"""Transposed convolutions: int8 weights per output channel (weight axis 1), batch norm folded,
int32 bias, exported as DQ(axis=1) -> ConvTranspose and run by ONNX Runtime.

References: a float64 recomputation of the fold, and ONNX Runtime against the torch QuantModel
(the agreement criterion of test_ort_agreement: >= 99.9% of outputs within 1 LSB, max 2).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.torch._fakequant import WeightQuantizer


class UpBlock(nn.Module):
    """conv -> BN -> ReLU -> ConvTranspose (x2) -> BN -> ReLU -> conv; an unfoldable BN after an add."""

    def __init__(self, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(8)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2, bias=False, groups=groups)
        self.bn1 = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 4, 1)
        self.bn2 = nn.BatchNorm2d(4)
        for bn in (self.bn0, self.bn1, self.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(-1.5, 1.5)  # negative gammas: the fold flips signs
            bn.bias.data.uniform_(-0.5, 0.5)

    def forward(self, x):
        y = torch.relu(self.bn1(self.up(torch.relu(self.bn0(self.conv(x))))))
        h = self.head(y)
        return self.bn2(h + 1.0)  # batch norm after an add: nothing to fold it into


def _ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def test_fold_into_conv_transpose_is_exact_in_float64():
    torch.manual_seed(0)
    m = UpBlock().eval().double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        expected = m(x)
        qm = qb.quantize(m, [x], progress=False, recipe="int8")
        with qb.float_mode(qm):
            got = qm(x)
    targets = [n.target for n in qm.graph.nodes if n.op == "call_function"]
    # bn0, bn1 folded; the one after the add runs as a depthwise 1x1 conv (torch/_bn_affine.py)
    assert targets.count(torch.ops.aten.batch_norm.default) == 0
    assert targets.count(torch.ops.aten.conv2d.default) == 3
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)  # float64 fold: exact-ish


def test_conv_transpose_weight_is_per_output_channel_and_ort_agrees():
    torch.manual_seed(0)
    qm = qb.quantize(
        UpBlock(), [torch.randn(8, 3, 6, 6) for _ in range(3)], progress=False, recipe="native"
    )
    quantizers = qm.quantizers()
    up = [q for name, q in quantizers.items() if isinstance(q, WeightQuantizer) and "up" in name]
    assert len(up) == 1 and up[0].axis == 1 and up[0].scale.numel() == 8
    x = torch.randn(16, 3, 6, 6)
    with torch.no_grad():
        y = qm(x).numpy()
    model = qb.onnx.to_onnx(qm, x[:2])
    assert qb.onnx.float_weights(model) == []
    dq_axes = {
        n.input[0]: next((a.i for a in n.attribute if a.name == "axis"), 1)
        for n in model.graph.node
        if n.op_type == "DequantizeLinear"
    }
    (ct,) = [n for n in model.graph.node if n.op_type == "ConvTranspose"]
    producer = {o: n for n in model.graph.node for o in n.output}[ct.input[1]]
    assert producer.op_type == "DequantizeLinear" and dq_axes[producer.input[0]] == 1
    assert len(ct.input) == 3  # the folded batch norm created an (int32) bias
    # the output is the last batch norm's (float): compare in units of the head's output scale
    head_q = [q for q in quantizers.values() if getattr(q, "kind", "") == "activation"][-1]
    err = np.abs(_ort(model, x.numpy()) - y) / head_q.scale.item()
    assert float((err <= 1.0 + 1e-3).mean()) >= 0.999 and err.max() <= 2.0 + 1e-3, err.max()


def test_grouped_conv_transpose_stays_float():
    """... and says so, naming the layer and the reason (before: silently float)."""
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"1 layer\(s\) with weights stay float.*'up': a grouped"):
        qm = qb.quantize(
            UpBlock(groups=2), [torch.randn(4, 3, 6, 6)], progress=False, recipe="int8"
        )
    weights = [q for q in qm.quantizers().values() if isinstance(q, WeightQuantizer)]
    assert not any(q.weight_name.startswith("up.") for q in weights)
    targets = [n.target for n in qm.graph.nodes if n.op == "call_function"]
    # up's BN is not folded into it: it runs as a depthwise 1x1 conv (torch/_bn_affine.py), as
    # does the BN after the add
    assert targets.count(torch.ops.aten.batch_norm.default) == 0
    assert targets.count(torch.ops.aten.conv2d.default) == 4


@pytest.mark.parametrize("groups", [1, 2])
def test_export_fast_path_equals_public_path(groups, fast_export, public_export):
    torch.manual_seed(0)
    qm = qb.quantize(
        UpBlock(groups), [torch.randn(4, 3, 6, 6) for _ in range(2)], progress=False, recipe="int8"
    )
    x = torch.randn(2, 3, 6, 6)
    quick = fast_export(qm, x)
    public = public_export(qm, x)
    batch = torch.randn(5, 3, 6, 6).numpy()
    np.testing.assert_array_equal(_ort(quick, batch), _ort(public, batch))  # 0 LSB


def test_a_rule_skipping_the_float_layer_silences_the_warning():
    import warnings

    recipe = qb.Recipe.preset("int8").with_rules(qb.Rule(pattern="up", skip=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qb.quantize(UpBlock(groups=2), [torch.randn(4, 3, 6, 6)], progress=False, recipe=recipe)
    assert not [w for w in caught if "stay float" in str(w.message)]
