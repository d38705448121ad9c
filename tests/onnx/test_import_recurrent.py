"""ONNX ``LSTM`` / ``GRU`` / ``RNN`` imported as torch recurrent layers (``importer/_recurrent``).

Regression: ``qb.import_onnx(qb.export(m))`` failed on any model with an LSTM or GRU ("unsupported
ops LSTM"): placement leaves recurrent layers float and the export writes ONNX LSTM / GRU nodes,
which the importer had no handler for.

Tolerance against ONNX Runtime (float32): ``atol=1e-6, rtol=1e-5``. Every output is a product of
sigmoids and tanhs (|h| <= 1, |c| grows by at most 1 a step) of the same float32 products; ORT's
MLAS sigmoid / tanh are approximations within a few float32 ulps of torch's and its gate sums run
in another order, so the two drift by a few ulps per step. Measured max: 1.2e-7 absolute on the
torch export (7 steps, 2 bidirectional LSTM layers then a GRU), 7.2e-7 over the single-node cases
(5 steps, weights of scale 0.5, relu RNN outputs above 1); the largest error is 0.17 of
``1e-6 + 1e-5 * |y|`` (bidirectional RNN), which is 10^4 below a wrong gate order or a missing
bias (errors of order 0.1 to 1).
"""

from __future__ import annotations

import re
import warnings
import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

import quantbridge as qb

TOL = {"atol": 1e-6, "rtol": 1e-5}  # module docstring
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _ort(model, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model if isinstance(model, (str, bytes)) else model.SerializeToString()
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _oracle(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """ORT's outputs; for ``layout=1`` (batch first), which ORT refuses, ORT's outputs of the
    same node with ``layout=0`` on the transposed inputs, transposed back (ONNX's definition)."""
    node = model.graph.node[0]
    layout = next((a for a in node.attribute if a.name == "layout"), None)
    if layout is None or layout.i == 0:
        return _ort(model, feeds)
    model = onnx.ModelProto.FromString(model.SerializeToString())
    next(a for a in model.graph.node[0].attribute if a.name == "layout").i = 0
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name in ("X", "H0", "C0"):
            dims[0].dim_value, dims[1].dim_value = dims[1].dim_value, dims[0].dim_value
    swapped = {n: v.swapaxes(0, 1) if n in ("X", "H0", "C0") else v for n, v in feeds.items()}
    y, *states = _ort(model, swapped)
    return [y.transpose(2, 0, 1, 3), *(s.swapaxes(0, 1) for s in states)]


def _torch(module, feeds: dict) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*(torch.from_numpy(v) for v in feeds.values()))
    return [o.numpy() for o in (out if isinstance(out, tuple) else (out,))]


class _Stack(nn.Module):
    """What torch.onnx.export writes for a 2-layer bidirectional LSTM (two LSTM nodes) and a GRU
    (``linear_before_reset=1``)."""

    def __init__(self):
        super().__init__()
        self.lstm, self.gru = nn.LSTM(6, 8, num_layers=2, bidirectional=True), nn.GRU(16, 5)

    def forward(self, x):
        y, (h, c) = self.lstm(x)
        z, hz = self.gru(y)
        return y, h, c, z, hz


def test_torch_exported_lstm_and_gru_match_ort(tmp_path):
    torch.manual_seed(0)
    path = str(tmp_path / "stack.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Stack().eval(), (torch.randn(7, 3, 6),), path, dynamo=False,
                          opset_version=17, input_names=["x"], dynamic_axes={"x": {1: "B"}})  # fmt: skip
    ops = [n.op_type for n in onnx.load(path).graph.node if n.op_type in ("LSTM", "GRU")]
    assert ops == ["LSTM", "LSTM", "GRU"]
    module = qb.import_onnx(path)
    feeds = {"x": np.random.default_rng(1).standard_normal((7, 2, 6)).astype(np.float32)}
    for got, ref in zip(_torch(module, feeds), _ort(path, feeds), strict=True):
        np.testing.assert_allclose(got, ref, **TOL)
    assert sum(isinstance(m, nn.LSTM) for m in module.modules()) == 2
    assert sum(isinstance(m, nn.GRU) for m in module.modules()) == 1


def _node_model(op, direction="forward", layout=0, initial=False, lengths=False, inputs=None,
                **attrs):  # fmt: skip
    """One ``op`` node, random constant weights, sequence 5, batch 3, input 4, hidden 6."""
    rng = np.random.default_rng(zlib.crc32(repr((op, direction, layout, initial)).encode()))
    d, h, i, t, b = (2 if direction == "bidirectional" else 1), 6, 4, 5, 3
    g = _GATES[op]
    consts = {
        "W": rng.standard_normal((d, g * h, i)).astype(np.float32) * 0.5,
        "R": rng.standard_normal((d, g * h, h)).astype(np.float32) * 0.5,
        "B": rng.standard_normal((d, 2 * g * h)).astype(np.float32) * 0.5,
    }
    names = ["X", "W", "R", "B", "", "", ""]
    batch_major = (b, d, h) if layout else (d, b, h)
    graph_inputs = {"X": (b, t, i) if layout else (t, b, i)}
    if lengths:
        names[4] = "L"
        consts["L"] = np.full(b, t, np.int32)
    if initial:
        names[5] = "H0"
        graph_inputs["H0"] = batch_major
        if op == "LSTM":
            names[6] = "C0"
            graph_inputs["C0"] = batch_major
    for name in inputs or ():  # weights fed at run time instead of stored
        graph_inputs[name] = consts.pop(name).shape
    names = names[: 7 if op == "LSTM" else 6]
    while not names[-1]:
        names.pop()
    outputs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, names, outputs, name=f"my_{op}", hidden_size=h,
                            direction=direction, layout=layout, **attrs)  # fmt: skip
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in graph_inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        [onnx.numpy_helper.from_array(v, n) for n, v in consts.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    rng = np.random.default_rng(7)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in graph_inputs.items()}
    return model, feeds


@pytest.mark.parametrize(
    ("op", "direction", "layout", "initial", "extra"),
    [
        ("LSTM", "reverse", 0, True, {}),
        ("LSTM", "bidirectional", 1, True, {}),
        ("LSTM", "forward", 0, False, {"lengths": True}),
        ("GRU", "bidirectional", 0, True, {"linear_before_reset": 1}),
        ("GRU", "reverse", 1, False, {"linear_before_reset": 1}),
        ("GRU", "bidirectional", 0, True, {}),  # linear_before_reset=0: GRUResetFirst
        ("GRU", "reverse", 1, False, {"linear_before_reset": 0}),
        ("RNN", "bidirectional", 0, True, {}),
        ("RNN", "forward", 1, False, {"activations": ["Relu"]}),
        ("LSTM", "bidirectional", 0, True, {"inputs": ("W", "R", "B")}),  # run-time weights
        ("GRU", "forward", 0, False, {"inputs": ("R",), "linear_before_reset": 1}),
        ("GRU", "bidirectional", 0, False, {"inputs": ("W", "B")}),
    ],
)
def test_onnx_semantics_match_ort(op, direction, layout, initial, extra):
    model, feeds = _node_model(op, direction, layout, initial, **extra)
    module = qb.import_onnx(model)
    layers = [m for m in module.modules() if isinstance(m, nn.RNNBase)]
    assert len(layers) == (0 if "inputs" in extra else 1)  # run-time weights: functional
    for got, ref in zip(_torch(module, feeds), _oracle(model, feeds), strict=True):
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, **TOL)


@pytest.mark.parametrize(
    ("op", "attrs", "match"),
    [
        ("LSTM", {"clip": 3.0}, "clip=3.0"),
        ("LSTM", {"activations": ["Sigmoid", "Relu", "Tanh"]}, "activations"),
        ("LSTM", {"input_forget": 1}, "input_forget"),
        ("RNN", {"activations": ["Sigmoid"]}, "activations"),
    ],
)
def test_unsupported_attributes_are_refused_naming_the_node(op, attrs, match):
    model, _ = _node_model(op, **attrs)
    with pytest.raises(ValueError, match=rf"'my_{op}'.*{match}"):
        qb.import_onnx(model)


def test_short_sequence_lens_are_refused_naming_the_node():
    model, feeds = _node_model("LSTM", lengths=True)
    lens = next(i for i in model.graph.initializer if i.name == "L")
    lens.CopyFrom(onnx.numpy_helper.from_array(np.array([5, 3, 5], np.int32), "L"))
    module = qb.import_onnx(model)
    with pytest.raises(ValueError, match=r"'my_LSTM'.*sequence_lens \[5, 3, 5\].*length 5"):
        _torch(module, feeds)


class _CRNN(nn.Module):
    """conv -> LSTM over the image columns -> linear, as a text-line recogniser is built."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.rnn = nn.LSTM(16, 8, bidirectional=True)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        columns = torch.relu(self.conv(x)).flatten(1, 2).permute(2, 0, 1)  # [W, B, C*H]
        return self.fc(self.rnn(columns)[0])


def _fc_input_step(path: str) -> float:
    """The scale of the grid the linear layer reads (the LSTM's output, quantized)."""
    model = onnx.load(path)
    producer = {o: n for n in model.graph.node for o in n.output}
    matmul = next(n for n in model.graph.node if n.op_type in ("MatMul", "Gemm"))
    dq = producer[matmul.input[0]]
    assert dq.op_type == "DequantizeLinear"
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    return float(inits[dq.input[1]])


@pytest.mark.filterwarnings("ignore:The tensor attributes")  # torch.export's note on nn.LSTM
def test_int8_crnn_round_trip_matches_ort_and_fine_tunes(tmp_path):
    """The regression: ``import_onnx(export(quantize(m)))`` of a model with an LSTM."""
    torch.manual_seed(0)
    data = [torch.randn(2, 1, 4, 10) for _ in range(3)]
    model = _CRNN().eval()
    with pytest.warns(UserWarning) as caught:
        qmodel = qb.quantize(model, data)
    texts = [str(w.message) for w in caught]
    assert any(
        re.search(r"1 layer\(s\) with weights stay float.*'rnn'.*recurrent", t, re.S) for t in texts
    )
    # torch's own advice about nn.LSTM's _flat_weights (assigned by torch on every call) is not
    # shown: the user cannot act on it
    assert not [t for t in texts if "_flat_weights" in t], texts
    # the float LSTM reads the int8 conv's output: the QuantModel's result is the float model's
    # within the quantized conv and linear's noise (measured 5.7e-5 relative error energy)
    with torch.no_grad():
        ref, approx = model(data[0]), qmodel(data[0])
    assert float(((ref - approx) ** 2).sum() / (ref**2).sum()) < 1e-2
    path = str(tmp_path / "crnn_int8.onnx")
    qb.export(qmodel, path, example_inputs=data[0])
    assert "LSTM" in {n.op_type for n in onnx.load(path).graph.node}
    imported = qb.import_onnx(path)
    x = np.random.default_rng(1).standard_normal((3, 1, 4, 10)).astype(np.float32)
    with torch.no_grad():
        got = imported(torch.from_numpy(x)).numpy()
    # within 1 step of the grid the linear layer reads: the LSTM's float output may round to the
    # neighbouring code where torch and ORT differ by an ulp at a rounding boundary (measured:
    # max difference 4.5e-8, no code moved)
    steps = np.abs(got - _ort(path, {"x": x})[0]) / _fc_input_step(path)
    assert steps.max() <= 1.0, steps.max()
    assert {"activation", "weight"} <= {
        getattr(q, "kind", None) for q in imported.quantizers().values()
    }
    # fine-tuning reaches the LSTM's weights
    lstm = {n: p.detach().clone() for n, p in imported.named_parameters() if "lstm" in n.lower()}
    assert len(lstm) == 8  # w_ih, w_hh, b_ih, b_hh per direction
    optimizer = torch.optim.SGD(imported.parameters(), lr=0.1)
    imported(torch.from_numpy(x)).square().mean().backward()
    optimizer.step()
    params = dict(imported.named_parameters())
    assert all(not torch.equal(params[n], before) for n, before in lstm.items())


@pytest.mark.parametrize("value", [0.0, 0.5])
def test_peepholes_zero_are_accepted_others_refused(value):
    model, feeds = _node_model("LSTM", direction="bidirectional")
    p = np.full((2, 3 * 6), value, np.float32)
    model.graph.initializer.append(onnx.numpy_helper.from_array(p, "P"))
    model.graph.node[0].input.extend(["", "", "", "P"])  # sequence_lens, initial_h, initial_c
    if value:
        with pytest.raises(ValueError, match=r"'my_LSTM'.*peephole"):
            qb.import_onnx(model)
        return
    for got, ref in zip(_torch(qb.import_onnx(model), feeds), _oracle(model, feeds), strict=True):
        np.testing.assert_allclose(got, ref, **TOL)


@pytest.mark.filterwarnings("ignore:The tensor attributes")  # torch.export's note on nn.LSTM
def test_integer_lstm_weights_are_dequantized_and_warned():
    """A QDQ file whose LSTM reads ``DequantizeLinear(int8 W)``: exact outputs, and a warning that
    the layer holds them float (no quantizer keeps them on the file's grid)."""
    model, feeds = _node_model("LSTM", direction="bidirectional")
    g = model.graph
    w = next(i for i in g.initializer if i.name == "W")
    values = onnx.numpy_helper.to_array(w)
    scale = np.float32(np.abs(values).max() / 127)
    codes = np.round(values / scale).astype(np.int8)
    g.initializer.remove(w)
    for name, value in {"Wq": codes, "ws": scale, "wz": np.int8(0), "xs": np.float32(0.02),
                        "xz": np.int8(0)}.items():  # fmt: skip
        g.initializer.append(onnx.numpy_helper.from_array(np.asarray(value), name))
    lstm = g.node[0]
    lstm.input[0] = "Xd"
    g.node.insert(0, helper.make_node("DequantizeLinear", ["Wq", "ws", "wz"], ["W"]))
    g.node.insert(1, helper.make_node("QuantizeLinear", ["X", "xs", "xz"], ["Xq"]))
    g.node.insert(2, helper.make_node("DequantizeLinear", ["Xq", "xs", "xz"], ["Xd"]))
    with pytest.warns(UserWarning, match=r"'my_LSTM'.*weights \['W'\] are integers in the file"):
        imported = qb.import_onnx(model)
    for got, ref in zip(_torch(imported, feeds), _oracle(model, feeds), strict=True):
        np.testing.assert_allclose(got, ref, **TOL)


def test_quantizing_a_reset_first_gru_names_the_layer_and_trains_its_weights():
    """ONNX's default GRU (``linear_before_reset=0``, ``GRUResetFirst``) read its weights through
    ``nn.GRU._flat_weights``, which ``torch.export`` lifted as constants: quantize's warning named
    ``my_GRU.lifted_tensor_0``, advised "write the product as nn.Linear", and the captured
    model's GRU weights got no gradient. Its first step on the zero initial state computed
    all-zero tensors, so calibration also warned about zeros at five ops. Since ``x @ W.T`` of a
    parameter is captured as a linear layer, the input products (``weight_ih``) are quantized;
    the recurrent products read row slices of ``weight_hh`` and stay float: named once per
    layer (they went unnamed when a slice hid the parameter: a silently float layer)."""
    model, feeds = _node_model("GRU", "bidirectional")
    module = qb.import_onnx(model)
    x = torch.from_numpy(feeds["X"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qmodel = qb.quantize(module, [x], progress=False)
    texts = [str(w.message) for w in caught]
    assert not [t for t in texts if "lifted_tensor" in t or "only zeros" in t], texts
    (left,) = [t for t in texts if "stay float" in t]
    assert "'my_GRU': a recurrent layer" in left and "my_GRU.weight_hh_l0" in left
    assert left.startswith("2 layer(s)"), left  # weight_hh_l0 and weight_hh_l0_reverse, once each
    quantized = {n for n, _ in qmodel.named_modules() if n.startswith("_quantbridge.my_GRU_weight")}
    assert quantized == {
        "_quantbridge.my_GRU_weight_ih_l0",
        "_quantbridge.my_GRU_weight_ih_l0_reverse",
    }
    y, _ = qmodel(x)
    y.square().sum().backward()
    grads = {n: p.grad for n, p in qmodel.named_parameters() if n.startswith("my_GRU.")}
    assert len(grads) == 8 and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    with torch.no_grad():  # the first step without the zero state's terms: same outputs as ORT
        for got, ref in zip(_torch(module, feeds), _ort(model, feeds), strict=True):
            np.testing.assert_allclose(got, ref, **TOL)
