"""int32 biases never saturate: a (nearly) dead weight channel's step is raised until its bias
fits (``numerics.fit_weight_scale_to_bias``), in PTQ, QAT and export; a live channel that needs
it warns, naming the layer."""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.demo import load_digits_split, train
from quantbridge.numerics import MIN_SCALE, bias_scale, quantize_bias

INT32_MAX = 2**31 - 1


def _node_by_node(path) -> ort.InferenceSession:
    options = ort.SessionOptions()  # the QDQ reference: exact with any weights
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.mark.slow
def test_slimmed_channel_keeps_its_bias_in_onnxruntime(tmp_path):
    """The trained digits CNN with one batch-norm channel slimmed (gamma 1e-6, beta 10, as
    network slimming leaves them): folded, that conv channel's weights are ~1e-7, under the floor
    ``qmax * 2**-23``, so its step was 2**-23 and its int32 bias step ``s_x * 2**-23``: the bias
    10 saturated at ``2**31 * s_x * 2**-23`` (2.6 here) and the channel's constant output was
    wrong in every engine.

    Bound: mean |error| of the ORT logits against float <= 1 output LSB and max <= 8. Measured
    (load ~5): 0.45 / 5.96 LSB with the fit, 9.04 / 24.0 on main (the same model with gamma 1,
    beta 0.1 measures 0.39 / 2.36, the trained net's own quantization noise)."""
    torch.manual_seed(0)
    x_train, y_train, x_test, _ = load_digits_split(0)
    model = train(x_train, y_train, epochs=1, seed=0, log=lambda line: None).eval()
    with torch.no_grad():
        model.bn2.weight[5], model.bn2.bias[5] = 1e-6, 10.0
    qmodel = qb.quantize(model, list(x_train[:256].split(64)), recipe="int8_avx2", progress=False)
    quantizers = qmodel.quantizers()
    s_x = quantizers["conv1/conv2d"].scale
    s_w = quantizers["conv2.weight"].scale
    # without the fit this bias saturates (main), with it the step was raised and it fits
    assert quantize_bias(np.array([10.0]), s_x, np.array([MIN_SCALE]))[0] == INT32_MAX
    assert s_w[5] > MIN_SCALE
    bias = qmodel.get_parameter(quantizers["conv2.bias"].bias_name).detach()
    assert abs(float(bias[5]) / float(bias_scale(s_x, s_w)[5])) < INT32_MAX
    qb.export(qmodel, tmp_path / "slim.onnx", x_test[:8])
    session = _node_by_node(tmp_path / "slim.onnx")
    got = session.run(None, {session.get_inputs()[0].name: x_test.numpy()})[0]
    with torch.no_grad():
        want = model(x_test).numpy()
    lsb = np.abs(got - want) / float(quantizers["fc2/linear_1"].scale)
    assert lsb.mean() <= 1.0 and lsb.max() <= 8.0, (lsb.mean(), lsb.max())


class _Conv(nn.Module):
    def __init__(self, bias: float):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        with torch.no_grad():
            self.conv.weight.copy_(torch.linspace(-0.01, 0.01, 108).reshape(4, 3, 3, 3))
            self.conv.bias.copy_(torch.tensor([0.0, bias, 0.0, 0.1]))

    def forward(self, x):
        return self.conv(x)


def _calib():  # input step ~1e-4: the bias step is ~1e-4 * 8e-5, int32 reaches ~17
    g = torch.Generator().manual_seed(0)
    return [torch.rand(2, 3, 6, 6, generator=g) * 0.0255 for _ in range(2)]


def test_live_channel_that_needs_it_warns_naming_the_layer():
    model = _Conv(bias=1000.0).eval()
    with pytest.warns(
        UserWarning, match=r"conv\.weight: the int32 bias of output channel\(s\) \[1\]"
    ):
        qmodel = qb.quantize(model, _calib(), recipe="int8", progress=False)
    q = qmodel.quantizers()
    codes = quantize_bias(model.conv.bias.detach(), q["input/x"].scale, q["conv.weight"].scale)
    assert np.abs(codes).max() < INT32_MAX
    x = _calib()[0]
    with torch.no_grad():
        err = (qmodel(x) - model(x)).abs().max()
    assert err <= float(q["conv/conv2d"].scale)  # channel 1 holds 1000: wrong by 999 if clipped


def test_biases_that_fit_leave_every_step_alone_and_qat_fits_at_freeze():
    model = _Conv(bias=1.0).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to raise: no warning, steps from the weights
        qmodel = qb.quantize(model, _calib(), recipe="int8", progress=False)
    w = model.conv.weight.detach()
    np.testing.assert_array_equal(
        qmodel.quantizers()["conv.weight"].scale.numpy(),
        (w.abs().amax(dim=(1, 2, 3)).double() / 127).float().numpy(),
    )
    qat = qb.prepare_qat(_Conv(bias=1000.0), calib_data=_calib())
    with pytest.warns(UserWarning, match="raised"):
        qb.freeze_observers(qat)
    q = qat.quantizers()
    codes = quantize_bias(
        qat.get_parameter("conv.bias").detach(), q["input/x"].scale, q["conv.weight"].scale
    )
    assert np.abs(codes).max() < INT32_MAX
