"""Fake quantization in torch: STE gradients against a mask reference, export-mode equality."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantbridge as qb
from quantbridge.numerics import fake_quantize
from quantbridge.torch._export_ops import export_mode
from quantbridge.torch._fakequant import FakeQuantizeSTE
from quantbridge.zoo import DigitsCNN, resnet18_style


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-50, 50, width=32), min_size=1, max_size=64),
    st.floats(0.01, 2.0),
    st.integers(0, 255),
)
def test_ste_forward_is_numerics_and_gradient_is_the_range_mask(values, scale, zero_point):
    x = torch.tensor(values, dtype=torch.float32, requires_grad=True)
    s = torch.tensor(scale, dtype=torch.float32)
    z = torch.tensor(zero_point, dtype=torch.int32)
    y = FakeQuantizeSTE.apply(x, s, z, 0, 255, None)
    np.testing.assert_array_equal(
        y.detach().numpy(),
        fake_quantize(np.asarray(values, np.float32), np.float32(s), zero_point, 0, 255),
    )
    y.backward(torch.arange(len(values), dtype=torch.float32) + 1)
    # float64 reference of the representable interval [(qmin - z) s, (qmax - z) s]
    lo, hi = (0 - zero_point) * float(s), (255 - zero_point) * float(s)
    mask = [(lo - 1e-6 * abs(lo) <= v <= hi + 1e-6 * abs(hi)) for v in values]
    inner = [(lo + 1e-5 * (1 + abs(lo)) < v < hi - 1e-5 * (1 + abs(hi))) for v in values]
    grad = x.grad.numpy()
    for i, (m, n) in enumerate(zip(mask, inner, strict=True)):
        if n:  # strictly inside: gradient passes
            assert grad[i] == i + 1
        elif not m:  # strictly outside: zero
            assert grad[i] == 0


def test_ste_per_channel_gradient_mask():
    x = torch.tensor([[-3.0, 0.5, 3.0], [-3.0, 0.5, 3.0]], requires_grad=True)
    scale = torch.tensor([0.01, 1.0])  # channel 0 saturates at +-1.27, channel 1 does not
    zero = torch.zeros(2, dtype=torch.int32)
    FakeQuantizeSTE.apply(x, scale, zero, -127, 127, 0).sum().backward()
    assert x.grad.tolist() == [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


def test_weight_gradients_flow_through_quantized_model():
    qm = qb.quantize(DigitsCNN(), [torch.randn(8, 1, 8, 8)], recipe="int8")
    qm.train()
    loss = qm(torch.randn(4, 1, 8, 8)).square().mean()
    loss.backward()
    for name in ("conv1.weight", "fc2.weight", "fc2.bias"):
        g = qm.get_parameter(name).grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name


def test_export_mode_computes_the_same_outputs_bit_for_bit():
    qm = qb.quantize(
        resnet18_style(num_classes=10, width=8), [torch.randn(4, 3, 32, 32)], recipe="int8"
    )
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        y = qm(x)
        with export_mode(qm):
            y_export = qm(x)
    assert torch.equal(y, y_export)
    # export mode is undone afterwards
    assert not any(getattr(m, "export_mode", False) for m in qm.modules())


def test_integer_weights_dequantize_to_the_fake_quantized_weights():
    qm = qb.quantize(DigitsCNN(), [torch.randn(4, 1, 8, 8)], recipe="int8")
    wq = qm.quantizers()["conv2.weight"]
    w = qm.get_parameter("conv2.weight")
    codes = wq.quantize_integers(w)
    assert codes.abs().max() <= 127  # narrow range int8
    deq = (codes - wq.zero_point.reshape(-1, 1, 1, 1)) * wq.scale.reshape(-1, 1, 1, 1)
    assert torch.equal(deq, wq(w))


def test_observing_weight_cache_is_bit_identical_and_follows_in_place_writes():
    """Calibration reuses a weight's fake-quantized copy while the weight is unchanged; any
    in-place write (version counter) or a gradient-enabled call recomputes it."""
    from quantbridge.recipe import resolve_recipe
    from quantbridge.torch._fakequant import WeightQuantizer

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3)
    wq = WeightQuantizer("conv.weight", resolve_recipe("int8").weights, axis=0)
    w = conv.weight

    def fresh():  # an uncached quantizer's answer for the current weight
        other = WeightQuantizer("conv.weight", resolve_recipe("int8").weights, axis=0)
        with torch.no_grad():
            return other(w)

    with torch.no_grad():
        first = wq(w)
        assert wq(w) is first  # cached
        torch.testing.assert_close(first, fresh(), rtol=0, atol=0)
        w.mul_(3.0)  # in-place write: the cached copy is stale
        third = wq(w)
    assert third is not first
    torch.testing.assert_close(third, fresh(), rtol=0, atol=0)
    with torch.no_grad():  # the scale follows the written weight too: max |w| / 127 per channel
        expected_scale = (w.detach().abs().amax(dim=(1, 2, 3)) / 127).float()
    torch.testing.assert_close(wq.scale.float(), expected_scale, rtol=1e-6, atol=0)
    out = wq(w)  # gradients enabled: never served from the cache
    assert out is not third and out.requires_grad
    wq.set_qparams(wq.scale, wq.zero_point)
    assert "_cache" not in wq.__dict__  # frozen quantizers hold no copy
