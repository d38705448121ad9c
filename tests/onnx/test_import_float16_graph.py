"""float16 quantized graphs (NVIDIA ModelOpt's default ONNX PTQ mode) import as float32.

ModelOpt writes whole-fp16 graphs: ``Cast(to=FLOAT16)`` after the input, float16 weights quantized
by ``QuantizeLinear`` with float16 scales, float16 biases and compute, ``Cast(to=FLOAT)`` before
the output. Before the fix the import refused every such file ("scale is float16"). The file here
is that pattern written by hand (ModelOpt is not a test dependency): the import must keep every
grid exactly (float16 values are float32 values), compute what the same graph computes in
float32, and warn that the file itself computes in float16.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb
from quantbridge.onnx.importer._fp16 import Float16GraphWarning

C, K, H, CLASSES = 3, 8, 6, 5
X_SCALE, A_SCALE = 0.03125, 0.0478  # the second is not exact in float16: rounded below


def _file(dtype=np.float16) -> onnx.ModelProto:
    """x -> Cast -> Q/DQ -> Conv 3x3 (fp16 weight Q/DQ'd per channel, bias) -> Relu -> Q/DQ ->
    GlobalAveragePool -> Flatten -> Gemm (weight Q/DQ'd per channel, bias) -> Cast -> y, with
    every constant float16 (``dtype=np.float32``: the same values stored as float32, no Casts)."""
    rng = np.random.default_rng(0)
    f = np.dtype(dtype)
    w1 = (0.3 * rng.standard_normal((K, C, 3, 3))).astype(np.float16).astype(f)
    w2 = (0.3 * rng.standard_normal((CLASSES, K))).astype(np.float16).astype(f)
    amax1, amax2 = np.abs(w1).reshape(K, -1).max(1), np.abs(w2).max(1)
    inits = [
        numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array((amax1 / 127).astype(np.float16).astype(f), "w1s"),
        numpy_helper.from_array((amax2 / 127).astype(np.float16).astype(f), "w2s"),
        numpy_helper.from_array(np.zeros(K, np.int8), "w1z"),
        numpy_helper.from_array(np.zeros(CLASSES, np.int8), "w2z"),
        numpy_helper.from_array(rng.standard_normal(K).astype(np.float16).astype(f), "b1"),
        numpy_helper.from_array(rng.standard_normal(CLASSES).astype(np.float16).astype(f), "b2"),
        numpy_helper.from_array(np.array(X_SCALE, f), "xs"),
        numpy_helper.from_array(np.array(A_SCALE, np.float16).astype(f), "as"),
        numpy_helper.from_array(np.array(0, np.int8), "z"),
    ]  # fmt: skip
    x_in = "x16" if f == np.float16 else "x"
    nodes = [
        helper.make_node("QuantizeLinear", [x_in, "xs", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "z"], ["xd"]),
        helper.make_node("QuantizeLinear", ["w1", "w1s", "w1z"], ["w1q"], axis=0),
        helper.make_node("DequantizeLinear", ["w1q", "w1s", "w1z"], ["w1d"], axis=0),
        helper.make_node("Conv", ["xd", "w1d", "b1"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "as", "z"], ["rq"]),
        helper.make_node("DequantizeLinear", ["rq", "as", "z"], ["rd"]),
        helper.make_node("GlobalAveragePool", ["rd"], ["p"]),
        helper.make_node("Flatten", ["p"], ["fl"]),
        helper.make_node("QuantizeLinear", ["w2", "w2s", "w2z"], ["w2q"], axis=0),
        helper.make_node("DequantizeLinear", ["w2q", "w2s", "w2z"], ["w2d"], axis=0),
        helper.make_node("Gemm", ["fl", "w2d", "b2"], ["y" if f == np.float32 else "y16"], transB=1),
    ]  # fmt: skip
    if f == np.float16:
        nodes.insert(
            0, helper.make_node("Cast", ["x"], ["x16"], name="in_cast", to=TensorProto.FLOAT16)
        )
        nodes.append(
            helper.make_node("Cast", ["y16"], ["y"], name="out_cast", to=TensorProto.FLOAT)
        )
    graph = helper.make_graph(
        nodes, "modelopt_like_fp16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", C, H, H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", CLASSES])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def test_float16_graph_imports_as_float32(tmp_path):
    model = _file()
    with pytest.warns(Float16GraphWarning, match=r"in_cast \(x -> float16\).*out_cast"):
        qmodel = qb.import_onnx(model.SerializeToString())
    x = np.random.default_rng(1).uniform(-4, 4, (4, C, H, H)).astype(np.float32)
    with torch.no_grad():
        y = qmodel(torch.from_numpy(x)).numpy()
    # the same graph stored in float32 (built independently of the import's widening): both
    # compute in float32 on the same grids; only the summation order differs
    expected32 = _ort(_file(np.float32), x)
    assert np.abs(y - expected32).max() <= 1e-5 * np.abs(expected32).max()
    # ORT on the float16 file: each op's result rounded to float16 (at most 2^-11 relative: DQ,
    # Conv, bias, pool, Gemm, bias in series, ~6 roundings), and a conv output that float16
    # rounding moves across a Q/DQ decision threshold gains or loses one step of A_SCALE (after
    # the pool, 1/36 of a step, ~2^-11 of the largest output per flip). Measured 1.4 to 2.7 *
    # 2^-11 of the largest output over 5 input seeds; 16 * 2^-11 (~0.8%) leaves ~6x margin
    expected16 = _ort(model, x)
    assert np.abs(y - expected16).max() <= 16 * 2.0**-11 * np.abs(expected16).max()
    # the grids are the file's float16 values, bit for bit, in the re-exported file
    path = tmp_path / "again.onnx"
    qb.export(qmodel, path, example_inputs=torch.from_numpy(x))
    again = onnx.load(str(path))
    # the file's input name, not torch's ``arg_0`` (toolfiles sweep: ModelOpt fp16 files)
    assert [i.name for i in again.graph.input] == [i.name for i in model.graph.input]
    scales = {
        float(v)
        for i in again.graph.initializer
        if i.data_type == TensorProto.FLOAT
        for v in numpy_helper.to_array(i).reshape(-1)[:1]
    }
    assert float(np.float16(A_SCALE)) in scales and X_SCALE in scales
    assert np.abs(_ort(again, x) - y).max() <= 1e-5 * np.abs(y).max()


def _float_lstm_file() -> onnx.ModelProto:
    """A float (unquantized) whole-float16 graph, as ModelOpt's default mode writes a model it
    quantizes nothing of: x -> Cast(float16) -> LSTM (float16 W, R, B) -> Squeeze -> Gemm
    (float16) -> Cast(float) -> y."""
    rng = np.random.default_rng(0)
    seq, batch, inp, hidden = 5, 2, 3, 4

    def f16(shape, name):
        return numpy_helper.from_array(rng.uniform(-0.5, 0.5, shape).astype(np.float16), name)

    inits = [f16((1, 4 * hidden, inp), "W"), f16((1, 4 * hidden, hidden), "R"),
             f16((1, 8 * hidden), "B"), f16((2, hidden), "fc_w"), f16((2,), "fc_b"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1")]  # fmt: skip
    nodes = [
        helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16, name="in_cast"),
        helper.make_node(
            "LSTM", ["x16", "W", "R", "B"], ["h_all", "h_last"], hidden_size=hidden, name="lstm"
        ),  # fmt: skip
        helper.make_node("Squeeze", ["h_all", "axis1"], ["h"], name="squeeze"),
        helper.make_node("Gemm", ["h_last_2d", "fc_w", "fc_b"], ["y16"], transB=1, name="fc"),
        helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT, name="out_cast"),
    ]
    nodes.insert(3, helper.make_node("Reshape", ["h_last", "shape"], ["h_last_2d"], name="flat"))
    inits.append(numpy_helper.from_array(np.array([batch, hidden], np.int64), "shape"))
    graph = helper.make_graph(
        nodes, "lstm16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, batch, inp])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 2]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT16, [seq, batch, hidden])],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_float16_float_graph_imports_trainable_float32_layers():
    """A float16 graph with nothing quantized took the float import, which kept it float16: the
    LSTM's float16 weights were refused as a layer (computed from frozen constants: only the Gemm
    trained, 2 of 6 parameters) and five Adam steps on the float16 Gemm gave a NaN loss
    (ModelOpt's default-mode file of an LSTM/GRU model, the import sweep of 2026-12-03). Now it
    is widened to float32 as a quantized float16 graph is: every layer trains."""
    model = _float_lstm_file()
    with pytest.warns(Float16GraphWarning, match=r"in_cast \(x -> float16\)"):
        module = qb.import_onnx(model.SerializeToString())
    params = dict(module.named_parameters())
    assert len(params) == 6 and all(p.dtype == torch.float32 for p in params.values())
    x = np.random.default_rng(1).uniform(-2, 2, (5, 2, 3)).astype(np.float32)
    with torch.no_grad():
        y = module(torch.from_numpy(x))[0].numpy()
    # ORT on the float16 file: at most each op's float16 rounding (2^-11 relative), 5 LSTM
    # steps plus the Gemm, |y| < 1: 4e-3 (~8 * 2^-11). Measured 6e-8 over 5 seeds (ORT's CPU
    # computes these float16 ops in float32 and rounds the results)
    expected = _ort(model, x)
    assert np.abs(y - expected).max() <= 4e-3
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    target = torch.zeros(2, 2)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(module(torch.from_numpy(x))[0], target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
