"""The one-trace export traces each quantizer export form once (``onnx/exporter/_reuse._form``):
quantizers of one class and configuration share one traced body, inlined with each one's own
tensors. The file must be the one tracing every quantizer on its own gives, byte for byte, also
when the model mixes configurations of one class: per-tensor uint8 weights next to per-channel
7-bit int8 ones, uint8 activations next to 7-bit int8 ones (other ``qmin`` / ``qmax``).
"""

from __future__ import annotations

import warnings

import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import quantbridge as qb
from quantbridge.onnx.exporter import _reuse
from quantbridge.torch._fakequant import Quantizer, WeightQuantizer

UINT8 = qb.QScheme(8, False, False, False, qb.PerTensor())  # asymmetric, per tensor
INT7 = qb.QScheme(7, True, True, True, qb.PerChannel(0))  # [-63, 63], per output channel
INT7_TENSOR = qb.QScheme(7, True, True, True, qb.PerTensor())


class TwoConvs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.conv2 = nn.Conv2d(4, 4, 3)
        self.conv3 = nn.Conv2d(4, 2, 3)

    def forward(self, x):
        return self.conv3(torch.relu(self.conv2(torch.relu(self.conv1(x)))))


def _qmodel():
    torch.manual_seed(0)
    recipe = qb.Recipe(
        weights=qb.TensorRecipe(INT7), activations=qb.TensorRecipe(UINT8)
    ).with_rules(
        qb.Rule(pattern="conv2", weights=qb.TensorRecipe(UINT8)),
        qb.Rule(pattern="conv3", activations=qb.TensorRecipe(INT7_TENSOR)),
    )
    data = [torch.randn(4, 3, 12, 12) for _ in range(2)]
    return qb.quantize(TwoConvs().eval(), data, recipe=recipe, progress=False), data[0][:1]


def _export(qmodel, example, path, monkeypatch, form) -> tuple[bytes, int]:
    """The file's bytes and the number of quantizer traces, ``_reuse._form`` being ``form``."""
    traces = []
    trace = _reuse._BufferTracer.trace
    with monkeypatch.context() as m:
        m.setattr(_reuse, "_form", form)
        m.setattr(_reuse._BufferTracer, "trace", lambda self, q: traces.append(q) or trace(self, q))
        m.setattr(torch.export, "export", _no_trace)  # the one-trace path, or fail
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the no-VNNI saturation warning: not the subject
            qb.export(qmodel, path, example)
    return path.read_bytes(), len(traces)


def _no_trace(*args, **kwargs):
    raise AssertionError("export traced the model again")


@pytest.fixture(scope="module")
def quantized():
    return _qmodel()


def test_shared_trace_gives_the_per_quantizer_file(quantized, tmp_path, monkeypatch):
    qmodel, example = quantized
    shared, n_shared = _export(qmodel, example, tmp_path / "s.onnx", monkeypatch, _reuse._form)
    alone, n_alone = _export(qmodel, example, tmp_path / "a.onnx", monkeypatch, lambda q: None)
    assert shared == alone
    # 3 weights, 3 biases, 4 activations (input, two relus, output): 10 traced alone; shared:
    # weights per channel / per tensor, biases per channel / per tensor (conv2's weight scale is
    # one number), activations uint8 / int7 -> 6
    assert (n_alone, n_shared) == (10, 6)
    # the configurations are in the file: each weight its own codes' type and axis
    model = onnx.load_from_string(shared)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    deq = {n.input[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    codes = {name: inits[name] for name in deq if name in inits and inits[name].ndim == 4}
    assert sorted(str(c.dtype) for c in codes.values()) == ["int8", "int8", "uint8"]
    for name, c in codes.items():
        axis = [a.i for a in deq[name].attribute if a.name == "axis"]
        if c.dtype == "uint8":  # conv2: per tensor
            assert inits[deq[name].input[1]].ndim == 0
        else:  # per output channel, 7 bits
            assert axis in ([], [0]) and inits[deq[name].input[1]].shape == (c.shape[0],)
            assert -63 <= c.min() and c.max() <= 63
    quantize = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    zero_types = {str(inits[n.input[2]].dtype) for n in quantize if n.input[2] in inits}
    assert zero_types == {"uint8", "int8"}


def test_forms_tell_configurations_apart(quantized):
    """Equal forms for quantizers of one configuration, others for another; a subclass whose
    forward is not the one ``export_reads`` was stated for has no form (traced alone)."""
    qmodel, _ = quantized
    weights = [m for m in qmodel.modules() if type(m) is WeightQuantizer]
    assert len(weights) == 3
    forms = [_reuse._form(w) for w in weights]
    assert None not in forms and len(set(forms)) == 2  # conv1 / conv3 per channel, conv2 not

    class Other(WeightQuantizer):
        def forward(self, w, observe=True):
            return w

    other = Other("other", qb.TensorRecipe(INT7), 0)
    assert _reuse._form(other) is None
    assert _reuse._form(Quantizer("q", qb.TensorRecipe(UINT8), "activation")) is not None
