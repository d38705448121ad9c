"""``qb.lower`` on ONNX Runtime's QDQ files with a LayerNormalization (regression sweep,
2026-12-02). ``quantize_static`` stores the LayerNormalization's scale as int8 and its bias as
int32, each followed by a DequantizeLinear (as for a conv's weight and bias). Before the fix the
lowering refused the scale ("scale must be a constant, got an integer constant": every
transformer and ConvNeXt that ORT quantizes in QDQ form) and, had the scale passed, would have
dropped an integer bias silently (it read only float constants as the bias).
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from torch import nn

import quantbridge as qb

logging.getLogger().setLevel(logging.ERROR)  # ORT's "consider pre-processing" advice
SHAPE = (2, 6, 16)


class _NormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 8)
        with torch.no_grad():  # a LayerNorm as trained: scale and bias far from 1 and 0
            self.norm.weight.uniform_(0.5, 2.0)
            self.norm.bias.uniform_(-1.0, 1.0)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


def _x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


class _Reader(CalibrationDataReader):
    def __init__(self):
        self._it = iter([{"x": _x(i)} for i in range(4)])

    def get_next(self):
        return next(self._it, None)


def test_ort_qdq_layernorm_with_integer_scale_and_bias_lowers(tmp_path):
    """The program agrees with ORT running the file node by node (float LayerNormalization on
    the dequantized scale and bias). Three requantized layers end to end: the integer layer
    norm differs from float by far less than half a code (``test_integer_transformer``), so a
    code moves only on a float tie and the next layer carries it: max 1 LSB of the output grid,
    most codes exact (measured: max 0, all exact)."""
    torch.manual_seed(0)
    src, path = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_NormBlock().eval(), (torch.from_numpy(_x(9)),), src, dynamo=False,
                          opset_version=17, input_names=["x"])  # fmt: skip
    quantize_static(src, path, _Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)  # fmt: skip
    model = onnx.load(path)
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name: i.data_type for i in model.graph.initializer}
    (norm,) = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    scale, bias = (producer[i] for i in norm.input[1:3])
    assert scale.op_type == bias.op_type == "DequantizeLinear"  # the pattern under test
    assert inits[scale.input[0]] == onnx.TensorProto.INT8
    assert inits[bias.input[0]] == onnx.TensorProto.INT32

    prog = qb.lower(path)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    ours, expected = [], []
    for seed in range(10, 14):  # the file's batch is static (2)
        out = prog.run({"x": _x(seed)})
        ours.append(out[0] if isinstance(out, (list, tuple)) else next(iter(out.values())))
        expected.append(sess.run(None, {"x": _x(seed)})[0])
    ours, expected = np.concatenate(ours), np.concatenate(expected)
    out = producer[model.graph.output[0].name]
    step = float(onnx.numpy_helper.to_array(
        next(i for i in model.graph.initializer if i.name == out.input[1])))  # fmt: skip
    steps = np.abs(ours - expected) / step
    assert steps.max() <= 1.001 and (steps < 0.5).mean() >= 0.95
