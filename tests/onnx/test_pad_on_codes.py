"""Zero padding shares its input's grid (``torch._ops.PAD_OPS``) and pads the int8 codes in the
exported file (``onnx/exporter/_pad_codes``).

Before the fix ``nn.ZeroPad2d`` / ``F.pad`` outputs got their own quantizer: the file held
``DQ -> Pad -> Q(new scale)``, a requantization, and ONNX Runtime ran the Pad in float between
two QLinearConvs. A 0 is on every affine grid, so the padded tensor is on its input's grid: the
file now pads the codes (constant = the zero point) and ONNX Runtime runs QLinearConv -> int8 Pad
-> QLinearConv with no QuantizeLinear in between.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import quantbridge as qb
from quantbridge._platform import u8s8_saturates
from quantbridge.recipe import native_preset
from quantbridge.torch import _ops
from quantbridge.torch._quantizer import Quantizer


class PadConv(nn.Module):
    def __init__(self, pad: nn.Module):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.c1, self.pad, self.c2 = nn.Conv2d(3, 8, 3), pad, nn.Conv2d(8, 4, 3)
        with torch.no_grad():
            for m in (self.c1, self.c2):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.3)
        self.eval()

    def forward(self, x):
        return self.c2(self.pad(torch.relu(self.c1(x))))


def _data(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 10, 10, generator=g) for _ in range(n)]


def _quantizers(q) -> list[str]:
    return sorted(m.name for m in q.modules() if type(m) is Quantizer)


def _session(path, optimized=None, level=None):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if level is not None:
        options.graph_optimization_level = level
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(
    "pad", [nn.ZeroPad2d((1, 2, 1, 0)), nn.ReflectionPad2d(1)], ids=["zero", "reflect"]
)
def test_padding_shares_the_grid_and_onnx_runtime_pads_codes(pad, tmp_path):
    model = PadConv(pad)
    # native_preset: the weights ONNX Runtime's fused int8 kernels compute exactly on this CPU
    # (7-bit where uint8 x int8 pair sums saturate, no VNNI: tests/onnx/test_saturation.py)
    q = qb.quantize(model, _data(3, 1), recipe=native_preset(), progress=False)
    # input, c1's output (through the relu) and c2's output: none for the pad
    assert _quantizers(q) == ["c1/conv2d", "c2/conv2d_1", "input/x"]
    x = _data(1, 2)[0]
    path = tmp_path / "pad.onnx"
    qb.export(q, path, example_inputs=x)
    file = onnx.load(str(path))
    producer = {o: n for n in file.graph.node for o in n.output}
    (node,) = [n for n in file.graph.node if n.op_type == "Pad"]
    assert producer[node.input[0]].op_type == "QuantizeLinear"  # pads codes: no DQ -> Pad -> Q
    ops = collections.Counter(n.op_type for n in file.graph.node)
    assert ops["QuantizeLinear"] == 3  # the input, c1's and c2's outputs: none after the Pad
    _session(path, optimized=tmp_path / "opt.onnx")
    fused = collections.Counter(n.op_type for n in onnx.load(tmp_path / "opt.onnx").graph.node)
    assert fused["QLinearConv"] == 2 and fused["QuantizeLinear"] == 1  # the input's alone
    # ONNX Runtime (fused: integer kernels, float requantization) against the QuantModel, in
    # steps of the output's grid: at most 1 LSB (design bound of requantization rounding)
    inits = {i.name: numpy_helper.to_array(i) for i in file.graph.initializer}
    last_dq = producer[file.graph.output[0].name]
    step = float(inits[last_dq.input[1]])
    with torch.no_grad():
        expected = q(x).numpy()
    (out,) = _session(path).run(None, {"x": x.numpy()})
    assert np.abs(out - expected).max() <= step * 1.0001
    # without optimizations ORT computes the QDQ graph in float as the fake-quant does
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    (plain,) = _session(path, level=off).run(None, {"x": x.numpy()})
    assert np.abs(plain - expected).max() <= step * 1.0001


@pytest.mark.parametrize("preset", ["int8_symmetric", "pow2"])
def test_symmetric_presets_pad_the_uint8_codes_after_a_relu(preset, tmp_path):
    """With a symmetric int8 grid the ReLU's output is stored uint8 (``_relu_quant``); the Q
    after the Pad stayed int8, so ``_pad_codes`` (equal parameters) did not apply and ONNX
    Runtime padded in float and quantized again. A zero Pad of a non-negative tensor is
    non-negative: the Q after it is uint8 too, and the Pad reads the codes."""
    q = qb.quantize(PadConv(nn.ZeroPad2d((1, 2, 1, 0))), _data(3, 1), recipe=preset,
                    progress=False)  # fmt: skip
    x = _data(1, 2)[0]
    path = tmp_path / "pad.onnx"
    qb.export(q, path, example_inputs=x)
    file = onnx.load(str(path))
    producer = {o: n for n in file.graph.node for o in n.output}
    (node,) = [n for n in file.graph.node if n.op_type == "Pad"]
    assert producer[node.input[0]].op_type in ("QuantizeLinear", "Clip")  # integer codes
    assert collections.Counter(n.op_type for n in file.graph.node)["QuantizeLinear"] == 3
    inits = {i.name: numpy_helper.to_array(i) for i in file.graph.initializer}
    step = float(inits[producer[file.graph.output[0].name].input[1]])
    with torch.no_grad():
        expected = q(x).numpy()
    # fused where this CPU adds pairs in int32 (VNNI); node by node where the fused kernels
    # saturate (no VNNI: these presets' 8-bit weights, tests/onnx/test_saturation.py)
    level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL if u8s8_saturates() else None
    (out,) = _session(path, level=level).run(None, {"x": x.numpy()})
    assert np.abs(out - expected).max() <= step * 1.0001  # requantization rounding: 1 LSB


def test_a_nonzero_constant_pad_keeps_its_own_grid(tmp_path):
    # 0.5 is in general off the input's grid: the padded tensor is quantized again, as before
    model = PadConv(nn.ConstantPad2d(1, 0.5))
    q = qb.quantize(model, _data(3, 1), recipe="int8", progress=False)
    assert "pad/pad" in _quantizers(q)
    path = tmp_path / "pad.onnx"
    x = _data(1, 2)[0]
    qb.export(q, path, example_inputs=x)
    file = onnx.load(str(path))
    producer = {o: n for n in file.graph.node for o in n.output}
    (node,) = [n for n in file.graph.node if n.op_type == "Pad"]
    assert producer[node.input[0]].op_type == "DequantizeLinear"


def test_a_checkpoint_from_before_keeps_its_pad_quantizer(tmp_path, monkeypatch):
    """A ``.qb`` saved when every pad had a quantizer of its own (no ``pads_on_grid`` in its
    header) loads as it was placed, bit for bit; a new one loads with the pad on its input's grid.
    Without the record the load would fail ("different architecture")."""
    model, data = PadConv(nn.ZeroPad2d(1)), _data(2, 1)
    with monkeypatch.context() as m:
        m.setattr(_ops, "PAD_OPS", {})  # the placement as it was: a pad was a float op
        old = qb.quantize(model, data, recipe="int8", progress=False)
    assert "pad/pad" in _quantizers(old)
    del old.qb_capture["pads_on_grid"]  # not in old headers
    qb.save(old, tmp_path / "old.qb")
    loaded = qb.load(tmp_path / "old.qb", PadConv(nn.ZeroPad2d(1)))
    assert _quantizers(loaded) == _quantizers(old)
    x = _data(1, 2)[0]
    with torch.no_grad():
        assert torch.equal(loaded(x), old(x))
    new = qb.quantize(model, data, recipe="int8", progress=False)
    qb.save(new, tmp_path / "new.qb")
    assert _quantizers(qb.load(tmp_path / "new.qb", PadConv(nn.ZeroPad2d(1)))) == _quantizers(new)
