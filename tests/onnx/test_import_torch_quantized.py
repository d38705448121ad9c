"""``import_onnx`` of torch's own quantized models (issue 9 part 2a).

What torch 2.13 can write: an eager-mode model quantized by ``torch.ao.quantization``
(``prepare`` / ``convert``) exports through the TorchScript exporter (``dynamo=False``) as QDQ, not
QOperator: ``QuantizeLinear -> Cast(to=uint8) -> DequantizeLinear`` around float Conv / Gemm / Add /
Concat, int8 weights and int32 biases in Constant nodes, each bias's zero point computed as
``ConstantOfShape -> Cast``. The dynamo exporter (torch 2.13's default) refuses such a model:
``torch.export`` fails on the packed parameters (``Conv2dPackedParamsBase ... does not have a field
with name '__obj_flatten__'``, asserted below), so no QOperator file comes out of torch today.

Agreement: against ONNX Runtime with graph optimisations off on the same file (the float
simulation the file specifies), within 1 step of the output's quantizer on every element
(measured: 0 on every element; 1 step allows float accumulation order, MLAS vs torch's conv).
Round trip: ``export(import(f))`` runs in ONNX Runtime with the same outputs as ``f``.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.ao.nn.quantized as nnq
import torch.ao.quantization as tq

import quantbridge as qb


class _Net(torch.nn.Module):
    """conv-bn-relu (fused), a depthwise conv, a quantized add and cat, max pool, linear."""

    def __init__(self):
        super().__init__()
        self.q, self.dq = tq.QuantStub(), tq.DeQuantStub()
        self.conv = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.bn, self.relu = torch.nn.BatchNorm2d(8), torch.nn.ReLU()
        self.dw = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.add, self.cat = nnq.FloatFunctional(), nnq.FloatFunctional()
        self.pool, self.fc = torch.nn.MaxPool2d(2), torch.nn.Linear(16 * 4 * 4, 5)

    def forward(self, x):
        a = self.relu(self.bn(self.conv(self.q(x))))
        b = self.add.add(a, self.dw(a))
        return self.dq(self.fc(torch.flatten(self.pool(self.cat.cat([a, b], 1)), 1)))


def _torch_quantized(backend: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = _Net().eval()
    model.qconfig = tq.get_default_qconfig(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notices
        prepared = tq.prepare(tq.fuse_modules(model, [["conv", "bn", "relu"]]))
        for _ in range(3):
            prepared(torch.randn(4, 1, 8, 8))
        return tq.convert(prepared)


def _export(model: torch.nn.Module, path) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (torch.randn(2, 1, 8, 8),), str(path), dynamo=False, opset_version=17,
            input_names=["x"], dynamic_axes={"x": {0: "b"}},
        )  # fmt: skip
    return str(path)


def _ort(path: str, x: np.ndarray, optimize: bool = False) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _output_step(path: str) -> float:
    """The scale of the last DequantizeLinear (the file's output grid)."""
    model = onnx.load(path)
    last = [n for n in model.graph.node if n.op_type == "DequantizeLinear"][-1]
    (scale,) = [n for n in model.graph.node if n.output[0] == last.input[1]]
    return float(onnx.numpy_helper.to_array(scale.attribute[0].t))


@pytest.mark.parametrize("backend", ["x86", "qnnpack"])  # per-channel / per-tensor weights
def test_torch_quantized_export_imports_and_matches_ort(backend, tmp_path):
    path = _export(_torch_quantized(backend), tmp_path / "tq.onnx")
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert {"Cast", "ConstantOfShape", "QuantizeLinear", "DequantizeLinear"} <= ops  # the form
    qmodel = qb.import_onnx(path)
    x = np.random.default_rng(1).standard_normal((16, 1, 8, 8)).astype(np.float32)
    got = qmodel(torch.from_numpy(x)).detach().numpy()
    steps = np.abs(got - _ort(path, x)) / _output_step(path)
    assert steps.max() <= 1.0 + 1e-3, steps.max()
    kinds = {q.kind for q in qmodel.quantizers().values() if hasattr(q, "kind")}
    assert kinds == {"activation", "weight"}  # the file's grids, not a float import
    # export(import(f)): the same outputs in ONNX Runtime
    out = tmp_path / "round_trip.onnx"
    qb.export(qmodel, out, example_inputs=torch.from_numpy(x[:2]))
    again = _ort(str(out), x)
    assert (np.abs(again - _ort(path, x)) / _output_step(path)).max() <= 1.0 + 1e-3


def test_torch_dynamo_exporter_refuses_quantized_modules(tmp_path):
    model = _torch_quantized("x86")
    with warnings.catch_warnings(), pytest.raises(Exception, match="__obj_flatten__"):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 1, 8, 8),), str(tmp_path / "d.onnx"), dynamo=True)


def test_cast_to_another_integer_type_is_refused(tmp_path):
    path = _export(_torch_quantized("x86"), tmp_path / "tq.onnx")
    model = onnx.load(path)
    cast = next(n for n in model.graph.node if n.op_type == "Cast" and n.attribute[0].i == 2)
    cast.attribute[0].i = onnx.TensorProto.INT8  # uint8 codes read as int8: another meaning
    with pytest.raises(
        ValueError, match=r"'/conv/Cast' \(op Cast\) casts the UINT8 codes .* to INT8"
    ):
        qb.import_onnx(model)
