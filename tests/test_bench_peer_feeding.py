"""How the bench feeds its ONNX peers (``bench/suite/peer_prep.py``, ``tools.quantize_ort``) and
when it calls a peer's file INT8 (``accuracy.weighted_inputs``, ``verdicts.not_int8``), on
hand-made graphs and rows.

The bug these pin (issue 14): on the PP-OCR line models (opset 12, weights in Constant nodes)
ORT's per-channel row quantized the weights as activations, per tensor, and NNCF wrote per-tensor
weights (per-channel needs opset 13): 9% and 0% of the recognizer's lines, where the same peers
read 90% and 94% given an opset-13 file with its weights as initializers. And NNCF's files, int8
convolutions in OpenVINO, were called "not INT8" because ONNX Runtime runs a conv without an
output Q in float."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.suite import accuracy, peer_prep, report_accuracy, tools, verdicts  # noqa: E402

C = 8  # output channels


def _weights() -> np.ndarray:
    """1x1 conv weights like PP-OCRv4 rec's ``p2o.Conv.28``: one channel 40x larger than the
    rest, so a per-tensor int8 grid leaves the others ~3 steps (or zero)."""
    rng = np.random.default_rng(0)
    w = rng.uniform(-0.5, 0.5, (C, 4, 1, 1)).astype(np.float32)
    w[0] *= 40
    return w


def _conv_file(path: Path, opset: int = 12) -> Path:
    """x -> Conv (weight and bias in Constant nodes, as Paddle2ONNX writes them) -> + 0 -> y."""
    w, b = _weights(), np.linspace(-1, 1, C).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(w)),
        helper.make_node("Constant", [], ["b"], value=numpy_helper.from_array(b)),
        # shape-like arithmetic (a Cast of a Constant) stays as it is: NNCF fails on a Cast of
        # an initializer
        helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array(0.0))),
        helper.make_node("Cast", ["k"], ["k32"], to=TensorProto.FLOAT),
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
        helper.make_node("Add", ["c", "k32"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", C, 6, 6])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    onnx.save(model, str(path))
    return path


def _run(path: Path, x: np.ndarray, optimize: bool = False) -> np.ndarray:
    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _x(n: int = 4) -> np.ndarray:
    return np.random.default_rng(1).uniform(0, 1, (n, 4, 6, 6)).astype(np.float32)


def test_prepare_moves_constant_weights_and_upgrades_the_opset_keeping_the_function(tmp_path):
    src = _conv_file(tmp_path / "f.onnx")
    assert peer_prep.needs_prepare(src)
    notes = peer_prep.prepare(src, tmp_path / "p.onnx")
    assert notes == {"constants_moved": 2, "opset": "12 -> 13"}
    model = onnx.load(str(tmp_path / "p.onnx"))
    assert [n.op_type for n in model.graph.node] == ["Constant", "Cast", "Conv", "Add"]
    assert sorted(i.name for i in model.graph.initializer) == ["b", "w"]
    assert peer_prep.default_opset(model) == 13 and not peer_prep.needs_prepare(tmp_path / "p.onnx")
    x = _x()
    # the same float function: same ops on the same float32 values, so the same bits
    np.testing.assert_array_equal(_run(tmp_path / "p.onnx", x), _run(src, x))


def test_ort_per_channel_on_an_opset_12_file_gets_per_channel_weights(tmp_path):
    """quantize_static(per_channel=True) on an opset-12 file writes an ``axis`` ORT refuses
    below opset 13; the bench upgrades the file first and the weights are per-channel."""
    src = _conv_file(tmp_path / "f.onnx")
    x = _x()
    feeds = [{"x": x[:2]}, {"x": x[2:]}]
    out = tmp_path / "q.onnx"
    info = tools.quantize_ort(
        src, feeds, "minmax", out, settings={"preprocess": True, "opset13": True}
    )
    assert info["preprocess"] == "defaults" and info["opset"] == "12 -> 13", info
    model = onnx.load(str(out))
    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    weight_dq = producer[next(n for n in model.graph.node if n.op_type == "Conv").input[1]]
    assert weight_dq.op_type == "DequantizeLinear"
    assert init[weight_dq.input[1]].shape == (C,)  # one scale per output channel
    scale = init[weight_dq.input[1]]
    codes = init[producer[weight_dq.input[0]].input[0]] if weight_dq.input[0] not in init else None
    codes = init[weight_dq.input[0]] if codes is None else codes
    w = _weights()
    # per channel: each channel's own grid (max |w_c| / 127), so every small channel keeps its
    # weights within half of its own step; one per-tensor step would be 40x coarser
    np.testing.assert_allclose(scale, np.abs(w).reshape(C, -1).max(1) / 127, rtol=1e-6)
    err = np.abs(codes.astype(np.float32) * scale[:, None, None, None] - w)
    assert (err <= scale[:, None, None, None] / 2 + 1e-7).all()
    assert _run(out, x).shape == (4, C, 6, 6)  # ONNX Runtime loads and runs the file


def _failing_until(n_failures: int, calls: list):
    """A pre-processing function that fails its first ``n_failures`` calls the way ORT's
    symbolic shape inference does (leaving its temp file in the working directory)."""

    def run(src, dst, **options):
        calls.append(options)
        if len(calls) <= n_failures:
            Path("sym_shape_infer_temp.onnx").write_bytes(b"x")
            raise Exception("Incomplete symbolic shape inference")
        Path(dst).write_bytes(Path(src).read_bytes())

    return run


def test_pre_process_tries_ort_documented_options_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = _conv_file(tmp_path / "f.onnx")
    calls: list = []
    info = tools.pre_process(src, tmp_path / "pre.onnx", run=_failing_until(1, calls))
    assert calls == [{}, {"auto_merge": True}]
    assert info == {
        "preprocess_error": "Exception: Incomplete symbolic shape inference",
        "preprocess": "auto_merge=True",
    }
    assert not (tmp_path / "sym_shape_infer_temp.onnx").exists()  # its leftover is removed
    calls.clear()
    info = tools.pre_process(src, tmp_path / "pre.onnx", run=_failing_until(2, calls))
    assert info["preprocess"] == "skip_symbolic_shape=True" and len(calls) == 3
    calls.clear()
    info = tools.pre_process(src, tmp_path / "pre.onnx", run=_failing_until(9, calls))
    assert "preprocess" not in info and info["preprocess_error"].startswith("Exception")
    assert len(calls) == len(peer_prep.PRE_PROCESS_OPTIONS)


def test_pre_process_keeps_a_leftover_that_was_there_before(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sym_shape_infer_temp.onnx").write_bytes(b"mine")
    tools.pre_process(_conv_file(tmp_path / "f.onnx"), tmp_path / "p.onnx", _failing_until(1, []))
    assert (tmp_path / "sym_shape_infer_temp.onnx").exists()


def _qdq(name: str) -> list:
    return [
        helper.make_node("QuantizeLinear", [name, "s", "z"], [f"{name}_q"]),
        helper.make_node("DequantizeLinear", [f"{name}_q", "s", "z"], [f"{name}_dq"]),
    ]


def test_weighted_inputs_counts_convs_and_matmuls_on_int8_values(tmp_path):
    """NNCF's layout: Q/DQ on conv inputs, no Q on outputs. Counted int8: a conv on dequantized
    input and weight, a MatMul whose operand is a Transpose of a dequantized tensor; float: a
    conv on a float input, a MatMul on a Concat of a dequantized and a float tensor."""
    w = numpy_helper.from_array(np.ones((2, 2, 1, 1), np.float32), "w")
    nodes = [*_qdq("x"), *_qdq("w")]
    nodes.append(helper.make_node("Conv", ["x_dq", "w_dq"], ["c1"]))  # int8
    nodes.append(helper.make_node("Conv", ["c1", "w_dq"], ["c2"]))  # float input
    nodes.append(helper.make_node("Transpose", ["x_dq"], ["t"], perm=[0, 1, 3, 2]))
    nodes.append(helper.make_node("MatMul", ["x_dq", "t"], ["m1"]))  # int8 through Transpose
    nodes.append(helper.make_node("Concat", ["x_dq", "c2"], ["cat"], axis=3))
    nodes.append(helper.make_node("MatMul", ["t", "cat"], ["m2"]))  # half float
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 3])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("m1", "m2")],
        [
            w,
            numpy_helper.from_array(np.array(0.1, np.float32), "s"),
            numpy_helper.from_array(np.array(0, np.int8), "z"),
        ],
    )
    onnx.save(helper.make_model(graph), str(tmp_path / "g.onnx"))
    counts = accuracy.weighted_inputs(tmp_path / "g.onnx")
    assert counts == {"file_int8_weighted": 2, "file_float_weighted": 2}


def test_residual_adds_counts_adds_of_two_int8_activations(tmp_path):
    """ModelOpt's CNN layout: a residual add whose shortcut is dequantized and whose other operand
    is a float conv output is float; an add of two dequantized values (one through a MaxPool) is
    int8; an add of a constant (a bias) is no residual add."""
    nodes = [*_qdq("x"), *_qdq("y")]
    nodes.append(helper.make_node("Relu", ["x"], ["r"]))  # float activation
    nodes.append(helper.make_node("Add", ["x_dq", "r"], ["a1"]))  # float
    nodes.append(helper.make_node("MaxPool", ["y_dq"], ["p"], kernel_shape=[1, 1]))
    nodes.append(helper.make_node("Add", ["x_dq", "p"], ["a2"]))  # int8 through MaxPool
    nodes.append(helper.make_node("Add", ["a1", "b"], ["a3"]))  # bias: not counted
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, 3, 3]) for n in ("x", "y")],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("a2", "a3")],
        [
            numpy_helper.from_array(np.ones((1, 2, 1, 1), np.float32), "b"),
            numpy_helper.from_array(np.array(0.1, np.float32), "s"),
            numpy_helper.from_array(np.array(0, np.int8), "z"),
        ],
    )
    onnx.save(helper.make_model(graph), str(tmp_path / "g.onnx"))
    assert accuracy.residual_adds(tmp_path / "g.onnx") == {
        "file_int8_adds": 1,
        "file_float_adds": 1,
    }


def _row(tool: str, value: float, default: bool, graph: dict) -> dict:
    return {"tool": tool, "config": "default" if default else "best", "method": "m",
            "default": default, "values": [value], "graph": graph}  # fmt: skip


NNCF_LIKE = {"file_int8_weighted": 45, "file_float_weighted": 6, "ort_int8_ops": 13,
             "ort_float_weighted_ops": 38}  # fmt: skip


def test_not_int8_reads_the_file_where_it_can_and_ort_otherwise():
    # NNCF's recognizer: ORT runs 38 convs float, but 45 of 51 multiply int8 values: INT8
    assert verdicts.not_int8({"graph": NNCF_LIKE}) is None
    mostly_float = {"file_int8_weighted": 3, "file_float_weighted": 48, "ort_int8_ops": 3}
    assert verdicts.not_int8({"graph": mostly_float}) == (
        "not INT8: 3 weighted ops with int8 inputs, 48 with float inputs"
    )
    # rows from before the file census: ONNX Runtime's census, as before
    old = {"ort_int8_ops": 0, "ort_float_weighted_ops": 21}
    assert verdicts.not_int8({"graph": old}) == "not INT8 in ORT: 0 int8 ops, 21 weighted ops float"


def test_a_peer_in_nncf_layout_ahead_of_ours_counts_as_ours_behind():
    ours = {"file_int8_weighted": 51, "file_float_weighted": 0, "ort_int8_ops": 261,
            "ort_float_weighted_ops": 3}  # fmt: skip
    acc = {
        "rows": [_row("quantbridge", 0.90625, True, ours), _row("nncf", 0.9375, True, NNCF_LIKE)]
    }
    default = next(c for c in verdicts.compare(acc, "lines") if c["kind"] == "default")
    assert default["status"] == "behind" and default["delta"]["median"] == 0.90625 - 0.9375


def test_the_table_says_how_each_peer_was_fed():
    ort_row = {"preprocess": "auto_merge=True", "preprocess_error": "Exception: Incomplete",
               "opset": "12 -> 13"}  # fmt: skip
    assert report_accuracy._fed(ort_row) == " (quant_pre_process auto_merge=True; opset 12 -> 13)"
    assert report_accuracy._fed({"preprocess_error": "x"}) == " (not pre-processed)"
    nncf_row = {"prepared": {"constants_moved": 420, "opset": "12 -> 13"}}
    assert (
        report_accuracy._fed(nncf_row) == " (420 Constant weights as initializers; opset 12 -> 13)"
    )
    assert report_accuracy._fed({}) == ""


def test_the_table_shows_the_files_census_beside_what_ort_ran():
    # NNCF's layout: the file multiplies int8 inputs in 45 of 51 convs, ORT runs 38 in float;
    # the row's cell must show both (the ORT part used to overwrite the file's census)
    graph = {"activation_q": 60, "float_weights_q": 0, **NNCF_LIKE}
    cell = report_accuracy._coverage(graph)
    assert cell == (
        f"60; int8 inputs: {NNCF_LIKE['file_int8_weighted']} of "
        f"{NNCF_LIKE['file_int8_weighted'] + NNCF_LIKE['file_float_weighted']} conv/gemm; "
        f"ORT: {NNCF_LIKE['ort_int8_ops']} int8 ops, {NNCF_LIKE['ort_float_weighted_ops']} "
        "float conv/gemm"
    )
