"""``quantbridge quantize`` / ``qb.quantize_onnx`` on small hand-built ONNX files.

* the file's interface survives: input/output names, static and dynamic dimensions (symbolic
  names kept), an opset-11 source comes out at opset 18 (or ``--opset``) and passes the checker;
* the int8 file agrees with itself run node by node (the translation) and with
  the float model within its quantization noise (counted in output steps);
* integer inputs pass through unquantized;
* calibration data as an ``.npz``, a folder of ``.npy`` files of different image sizes, and
  every bad-input case as one line.

The PP-OCR end-to-end tests are in ``test_quantize_onnx_ocr.py``.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb
from quantbridge.cli import main
from quantbridge.onnx.quantizer import CalibrationSet, graph_inputs
from quantbridge.recipe import native_preset


def _cnn(opset: int = 11, batch="N", height="H", width="W") -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm, random weights,
    input ``input.1`` of shape [batch, 3, height, width], output ``logits``."""
    rng = np.random.default_rng(0)

    def init(name, *shape, scale=None):
        scale = scale if scale is not None else np.sqrt(2.0 / np.prod(shape[1:]))
        value = (rng.standard_normal(shape) * scale).astype(np.float32)
        return numpy_helper.from_array(value, name)

    nodes = [
        helper.make_node("Conv", ["input.1", "w1", "b1"], ["c1"], name="conv1", pads=[1] * 4),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1] * 4),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "w3", "b3"], ["logits"], name="fc", transB=1),
    ]
    inits = [
        init("w1", 8, 3, 3, 3),
        init("b1", 8, scale=0.1),
        init("w2", 16, 8, 3, 3),
        init("b2", 16, scale=0.1),
        init("w3", 10, 16),
        init("b3", 10, scale=0.1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [batch, 3, height, width])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    return model


def _images(seed: int, n: int, height: int = 16, width: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 3, height, width), dtype=np.float32)


def _dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def _run(model, feeds: dict, optimize: bool = True) -> list[np.ndarray]:
    """ORT outputs; ``optimize=False`` runs Q, DQ and float ops node by node (no int8 fusion)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(
        model.SerializeToString(), so, providers=["CPUExecutionProvider"]
    ).run(None, feeds)


def _output_step(model: onnx.ModelProto) -> float:
    """Scale of the quantizer on the graph output (from the export's record of quantizers)."""
    record = json.loads({p.key: p.value for p in model.metadata_props}["quantbridge.quantizers"])
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    out = model.graph.output[0].name
    (dq,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == out]
    assert dq.input[1] in {r["scale"] for r in record.values()}
    return float(inits[dq.input[1]])


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The opset-11 CNN with dynamic batch, height and width, quantized through the CLI from
    an .npz of 32 images."""
    work = tmp_path_factory.mktemp("cnn")
    onnx.save(_cnn(), work / "cnn.onnx")
    np.savez(work / "calib.npz", **{"input.1": _images(1, 32)})
    out = work / "cnn.int8.onnx"
    args = ["quantize", str(work / "cnn.onnx"), "--calib", str(work / "calib.npz")]
    assert main([*args, "-o", str(out), "--recipe", "int8", "--quiet"]) == 0
    return onnx.load(str(out))


def test_quiet_prints_nothing(tmp_path, capfd):
    """Regression: ``--quiet`` still printed the export stage line ("exporting to ONNX")."""
    onnx.save(_cnn(), tmp_path / "cnn.onnx")
    np.savez(tmp_path / "calib.npz", **{"input.1": _images(1, 4)})
    args = ["quantize", str(tmp_path / "cnn.onnx"), "--calib", str(tmp_path / "calib.npz")]
    capfd.readouterr()
    # the native preset: on a CPU without VNNI int8 prints its saturation warning, which --quiet
    # keeps (a warning is not progress)
    recipe = native_preset()
    assert main([*args, "-o", str(tmp_path / "q.onnx"), "--recipe", recipe, "--quiet"]) == 0
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


def test_interface_and_opset_survive(quantized):
    onnx.checker.check_model(quantized, full_check=True)
    assert {o.domain: o.version for o in quantized.opset_import}[""] == 18  # from opset 11
    (x,), (y,) = quantized.graph.input, quantized.graph.output
    assert (x.name, _dims(x)) == ("input.1", ["N", 3, "H", "W"])
    assert (y.name, _dims(y)) == ("logits", ["N", 10])
    report = qb.onnx.inspect_model(quantized)
    assert report.int8_ops.get("Conv") == 2 and report.float_weights == []


def test_agrees_with_float(quantized):
    """Other batch and image sizes run (dynamic dims). Error against the float model in steps of
    the output quantizer, over 64 images: run node by node (ORT without graph optimizations:
    QuantizeLinear, DequantizeLinear and float ops, the fake-quant arithmetic) measured mean
    0.64-0.68 steps; the optimized session (fused int8 kernels that requantize the pooled
    features with their own rounding, and one pooled step is ~5 output steps here) measured
    1.6 steps. Bounds 1.0 and 2.5."""
    x = _images(2, 64, 24, 20)
    (y,) = _run(quantized, {"input.1": x})
    (y_ref,) = _run(quantized, {"input.1": x}, optimize=False)
    (y_float,) = _run(_cnn(), {"input.1": x})
    assert y.shape == (64, 10)
    step = _output_step(quantized)
    assert np.abs(y_ref - y_float).mean() <= 1.0 * step
    assert np.abs(y - y_float).mean() <= 2.5 * step
    assert (y.argmax(1) == y_float.argmax(1)).mean() >= 0.9


def test_integer_inputs_pass_through(tmp_path):
    """An int64 mask input (cast to float, multiplied in) stays int64 and unquantized; the
    float input is quantized; the result runs in ORT, close to float when run node by node
    (measured max error 0.056 of 3.8; the fused u8 x s8 kernel saturates its 16-bit pair sums on
    AVX2 CPUs without VNNI, a known ONNX Runtime limitation, so it is not the reference here)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
            helper.make_node("Cast", ["mask"], ["maskf"], name="cast", to=TensorProto.FLOAT),
            helper.make_node("Mul", ["h", "maskf"], ["y"], name="apply"),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8]),
            helper.make_tensor_value_info("mask", TensorProto.INT64, ["n", 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [w],
    )
    src = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    feeds = {
        "x": rng.standard_normal((16, 8)).astype(np.float32),
        "mask": rng.integers(0, 2, (16, 8)),
    }
    out = qb.quantize_onnx(src, feeds, tmp_path / "q.onnx", progress=False, recipe="int8")
    mask = next(i for i in out.graph.input if i.name == "mask")
    assert mask.type.tensor_type.elem_type == TensorProto.INT64
    consumers = {n.op_type for n in out.graph.node if "mask" in n.input}
    assert consumers and "QuantizeLinear" not in consumers
    assert sum(n.op_type == "QuantizeLinear" and n.input[0] == "x" for n in out.graph.node) == 1
    small = {k: v[:3] for k, v in feeds.items()}
    (y,) = _run(out, small, optimize=False)
    (y_float,) = _run(src, small)
    assert np.abs(y - y_float).max() < 0.05 * np.abs(y_float).max()
    assert _run(out, small)[0].shape == (3, 8)


def test_folder_of_npy_with_image_sizes_and_opset(tmp_path):
    """A folder of .npy files of two image sizes (batches never mix files); --opset 13; a recipe
    file; static batch and height of the source stay static."""
    (tmp_path / "calib").mkdir()
    np.save(tmp_path / "calib" / "a.npy", _images(3, 4, 16, 16))
    np.save(tmp_path / "calib" / "b.npy", _images(4, 3, 16, 32))
    onnx.save(_cnn(batch=1, height=16), tmp_path / "cnn.onnx")
    (tmp_path / "r.yaml").write_text(qb.Recipe.preset("int8_symmetric").to_yaml())
    out = tmp_path / "q.onnx"
    args = ["quantize", str(tmp_path / "cnn.onnx"), "--calib", str(tmp_path / "calib")]
    args += ["-o", str(out), "--opset", "13", "--recipe", str(tmp_path / "r.yaml"), "--quiet"]
    assert main(args) == 0
    model = onnx.load(str(out))
    assert {o.domain: o.version for o in model.opset_import}[""] == 13
    assert _dims(model.graph.input[0]) == [1, 3, 16, "W"]
    zero_points = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    inits = {i.name: i for i in model.graph.initializer}
    # symmetric: zero point 0 everywhere; int8, or uint8 [0, 127] for non-negative tensors (after
    # a ReLU: the form ONNX Runtime fuses, onnx/exporter/_relu_quant)
    assert all(numpy_helper.to_array(inits[n.input[2]]) == 0 for n in zero_points)
    types = {inits[n.input[2]].data_type for n in zero_points}
    assert TensorProto.INT8 in types and types <= {TensorProto.INT8, TensorProto.UINT8}
    (y,) = _run(model, {"input.1": _images(5, 1, 16, 40)})
    assert y.shape == (1, 10)


# -- bad input: one line each --------------------------------------------------------------------
def _inputs(**kw):
    return graph_inputs(_cnn(**kw))


@pytest.mark.parametrize(
    "arrays,message",
    [
        ({"x": _images(0, 2)}, "array 'x' is not an input of the model; the model's inputs are"),
        ({}, "no array for input 'input.1'"),
        ({"input.1": np.zeros((2, 3, 16), np.float32)}, "expected 4 dimensions"),
        ({"input.1": np.zeros((2, 4, 16, 16), np.float32)}, "dimension 1 is 4, the model needs 3"),
        ({"input.1": np.zeros((2, 3, 16, 16), np.int64)}, "dtype int64 does not fit input"),
        ({"input.1": np.zeros((0, 3, 16, 16), np.float32)}, "holds no samples"),
    ],
)
def test_bad_calibration_arrays(arrays, message):
    with pytest.raises(ValueError, match=message):
        CalibrationSet(arrays, _inputs())


def test_calibration_batches_and_casts():
    data = CalibrationSet({"input.1": _images(0, 10).astype(np.float64)}, _inputs(), 4)
    batches = list(data)
    assert len(data) == len(batches) == 3 and [b[0].shape[0] for b in batches] == [4, 4, 2]
    assert batches[0][0].dtype == __import__("torch").float32
    fixed = CalibrationSet({"input.1": _images(0, 5)}, _inputs(batch=2))
    assert fixed.batch_size == 2 and len(list(fixed)) == 2  # the fifth sample is dropped
    with pytest.raises(ValueError, match="fixed at 2; use batch_size=2"):
        CalibrationSet({"input.1": _images(0, 5)}, _inputs(batch=2), 3)
    with pytest.raises(ValueError, match="fewer than the model's fixed batch size 2"):
        CalibrationSet({"input.1": _images(0, 1)}, _inputs(batch=2))


def test_cli_errors_are_one_line(tmp_path, capsys):
    onnx.save(_cnn(), tmp_path / "cnn.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"not a model at all")
    np.savez(tmp_path / "wrong.npz", image=_images(0, 2))
    (tmp_path / "empty").mkdir()
    np.save(tmp_path / "ok.npy", _images(0, 2))
    cases = [
        (["junk.onnx", "--calib", "ok.npy"], "is not a readable ONNX model"),
        (["missing.onnx", "--calib", "ok.npy"], "no ONNX file at"),
        (["cnn.onnx", "--calib", "wrong.npz"], "array 'image' is not an input"),
        (["cnn.onnx", "--calib", "empty"], "no .npz or .npy files found"),
        (["cnn.onnx", "--calib", "nothing.npz"], "no such file or folder"),
        (["cnn.onnx", "--calib", "ok.npy", "--opset", "12"], "needs opset >= 13"),
        (["cnn.onnx", "--calib", "ok.npy", "--recipe", "int9"], "unknown recipe preset 'int9'"),
    ]
    for args, message in cases:
        paths = [
            str(tmp_path / a) if a.endswith((".onnx", ".npy", ".npz")) or a == "empty" else a
            for a in args
        ]
        assert main(["quantize", *paths, "-o", str(tmp_path / "out.onnx")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.onnx").exists()


# -- the concat trap -----------------------------------------------------------------------------
def _detector_head() -> onnx.ModelProto:
    """A detector's output: box coordinates in pixels (``Relu(conv) * 320``, span ~10^3) and
    class probabilities (``Sigmoid(conv)``, span < 1) joined by one Concat, the graph output."""
    rng = np.random.default_rng(0)

    def w(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.5).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["f"], name="stem", pads=[1] * 4),
        helper.make_node("Relu", ["f"], ["fr"], name="stem_relu"),
        helper.make_node("Conv", ["fr", "wb"], ["b0"], name="box_conv"),
        helper.make_node("Relu", ["b0"], ["b1"], name="box_relu"),
        helper.make_node("Mul", ["b1", "pixels"], ["boxes"], name="box_scale"),
        helper.make_node("Conv", ["fr", "wp"], ["p0"], name="cls_conv"),
        helper.make_node("Sigmoid", ["p0"], ["probs"], name="cls_sigmoid"),
        helper.make_node("Concat", ["boxes", "probs"], ["out"], name="head", axis=1),
    ]
    pixels = numpy_helper.from_array(np.array(320.0, np.float32), "pixels")
    graph = helper.make_graph(
        nodes,
        "det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 8, 8, 8])],
        [w("w0", 8, 3, 3, 3), w("wb", 4, 8, 1, 1), w("wp", 4, 8, 1, 1), pixels],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_concat_of_different_ranges_keeps_separate_scales(tmp_path, monkeypatch):
    """The probabilities keep their precision: separate input scales, float Concat, and
    ``inspect`` says so. Measured max probability error 0.004 (node by node; about one step of
    1/255). Negative control, the range check switched off: one shared scale of ~4 (the boxes'
    span / 255), the probabilities round to 0 or 4: error 0.5+."""
    src = _detector_head()
    calib = {"x": _images(0, 16, 8, 8)}
    x = _images(1, 8, 8, 8)
    (y_float,) = _run(src, {"x": x})
    assert np.ptp(y_float[:, :4]) > 100 * np.ptp(y_float[:, 4:])  # the trap is there

    out = qb.quantize_onnx(src, calib, tmp_path / "q.onnx", progress=False, recipe="int8")
    (y,) = _run(out, {"x": x}, optimize=False)
    assert np.abs(y[:, 4:] - y_float[:, 4:]).max() <= 0.02
    (concat,) = [n for n in out.graph.node if n.op_type == "Concat"]
    assert all(out_of(out, t).op_type == "DequantizeLinear" for t in concat.input)
    assert not any(
        n.op_type == "QuantizeLinear" and concat.output[0] in n.input for n in out.graph.node
    )
    (line,) = qb.onnx.inspect_model(out).concats
    assert "2 inputs on their own scales" in line and line.endswith("output float")
    assert "concats on separate scales" in qb.onnx.inspect_model(out).format()

    from quantbridge.torch import _quantize

    monkeypatch.setattr(_quantize, "mismatched_concats", lambda *a, **k: {})
    shared = qb.quantize_onnx(src, calib, None, progress=False, recipe="int8")
    (y_shared,) = _run(shared, {"x": x}, optimize=False)
    assert np.abs(y_shared[:, 4:] - y_float[:, 4:]).max() >= 0.3
    assert qb.onnx.inspect_model(shared).concats == []


def out_of(model: onnx.ModelProto, tensor: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if tensor in n.output)


def test_head_layers():
    """A layer reaching the output through Softmax (and a bias Add) is the float head; a layer
    that is itself the output, or feeds a Concat, is not."""
    from quantbridge.onnx.quantizer._head import head_layers

    assert head_layers(_cnn()) == []  # fc is the graph output itself
    assert head_layers(_detector_head()) == []  # the convs feed a Concat
    model = _cnn()
    fc = next(n for n in model.graph.node if n.name == "fc")
    fc.output[0] = "pre"
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(10, np.float32), "bias2"))
    model.graph.node.extend(
        [
            helper.make_node("Add", ["pre", "bias2"], ["z"], name="bias"),
            helper.make_node("Softmax", ["z"], ["logits"], name="softmax"),
        ]
    )
    assert head_layers(model) == ["fc"]
