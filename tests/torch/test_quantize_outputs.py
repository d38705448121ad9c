"""``Recipe(quantize_outputs=False)``: a value read only as a graph output (directly or through
flatten / reshape / dropout) keeps a float output; every other quantizer stays where it was.
The exported file runs in ONNX Runtime as torch computes it, and its output error against the
float model is lower than with the output rounded to 8 bits."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantbridge as qb


class SmallCNN(nn.Module):
    """conv-relu-conv-relu-pool-linear, ending in a reshape when ``reshape_out``."""

    def __init__(self, reshape_out: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)
        self.reshape_out = reshape_out

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        y = self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
        return y.reshape(-1, 2, 5) if self.reshape_out else y


class TwoOutputs(nn.Module):
    """``y`` is a graph output and also read by ``fc2``: it keeps its quantizer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        y = self.fc1(x)
        return y, self.fc2(y)


def _images(seed: int, n: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 12, 12, generator=g) for _ in range(n)]


def _activation_modules(qmodel) -> list[str]:
    return sorted(p.module for p in qmodel.qb_points if p.kind == "activation")


def test_default_keeps_output_quantizer_and_round_trips():
    # integer-only lowering (qb.lower, integer_mode) needs integer graph outputs: default True
    assert qb.Recipe().quantize_outputs is True
    assert all(qb.Recipe.preset(n).quantize_outputs for n in ("int8", "native", "pow2"))
    r = qb.Recipe(quantize_outputs=False)
    assert qb.Recipe.from_dict(r.to_dict()) == r
    assert qb.Recipe.from_dict({}).quantize_outputs is True  # older saved recipes


@pytest.mark.parametrize("reshape_out", [False, True])
def test_only_the_graph_output_quantizer_is_dropped(reshape_out):
    calib = _images(1)
    on = qb.quantize(SmallCNN(reshape_out).eval(), calib, "native", progress=False)
    recipe = dataclasses.replace(qb.Recipe.preset("native"), quantize_outputs=False)
    off = qb.quantize(SmallCNN(reshape_out).eval(), calib, recipe, progress=False)
    with_out, without = _activation_modules(on), _activation_modules(off)
    assert with_out.count("fc") == without.count("fc") + 1, (with_out, without)
    # the linear's input (after pooling) and every conv's input are still quantized
    assert [m for m in with_out if m != "fc"] == [m for m in without if m != "fc"]
    assert "fc.weight" in off.quantizers()
    assert off.qb_outputs == [None] and on.qb_outputs[0] is not None


def test_float_output_survives_save_and_load(tmp_path):
    recipe = dataclasses.replace(qb.Recipe.preset("native"), quantize_outputs=False)
    q = qb.quantize(SmallCNN().eval(), _images(1), recipe, progress=False)
    qb.save(q, tmp_path / "q.pt")
    loaded = qb.load(tmp_path / "q.pt", SmallCNN().eval())
    assert loaded.qb_outputs == [None]
    (x,) = _images(3, 1)
    with torch.no_grad():
        assert torch.equal(loaded(x), q(x))  # the same placement replayed: bit-identical


def test_output_read_by_another_layer_stays_quantized():
    calib = [torch.randn(4, 16, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    recipe = qb.Recipe(quantize_outputs=False)
    q = qb.quantize(TwoOutputs().eval(), calib, recipe, progress=False)
    modules = _activation_modules(q)
    assert "fc1" in modules and "fc2" not in modules, modules


def _sqnr(ref: np.ndarray, out: np.ndarray) -> float:
    ref, out = ref.astype(np.float64), out.astype(np.float64)
    return float(10 * np.log10(np.sum(ref**2) / np.sum((ref - out) ** 2)))


def test_float_output_runs_in_ort_and_lowers_the_error(tmp_path):
    model = SmallCNN().eval()
    calib, (x,) = _images(1, 4), _images(2, 1)
    with torch.no_grad():
        ref = model(x).numpy()
    sqnr = {}
    for flag in (True, False):
        recipe = dataclasses.replace(qb.Recipe.preset("native"), quantize_outputs=flag)
        q = qb.quantize(model, calib, recipe, progress=False)
        path = tmp_path / f"out_{flag}.onnx"
        qb.export(q, path, x)
        graph = onnx.load(str(path)).graph
        producer = {o: n.op_type for n in graph.node for o in n.output}
        assert producer[graph.output[0].name] == ("DequantizeLinear" if flag else "Gemm")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        with torch.no_grad():
            expected = q(x).numpy()
        if not flag:
            # node-by-node ORT computes torch's fake-quant graph in float32; what differs is
            # summation order (<= 72 products per conv output): far below 1e-4 of the output
            assert np.abs(out - expected).max() <= 1e-4 * np.abs(expected).max()
        sqnr[flag] = _sqnr(ref, out)
    # the output's 8-bit rounding is one more independent error source
    assert sqnr[False] > sqnr[True], sqnr
