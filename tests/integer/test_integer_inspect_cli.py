"""Issue 10 leftovers, from the command line: ``quantbridge quantize --format qoperator`` writes
the folded QOperator file, and ``quantbridge inspect --fixed-point`` (or ``inspect PROGRAM.npz``)
shows each tensor's fixed-point format and each requantization's multiplier and shift."""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import onnxruntime as ort
import torch

import quantbridge as qb
from quantbridge.cli import main
from quantbridge.zoo import DigitsCNN


def _run(path, x, optimize=True):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_quantize_format_qoperator_writes_the_folded_file(tmp_path):
    torch.manual_seed(0)
    model = DigitsCNN().eval()
    onnx.save(qb.onnx.exporter.float_to_onnx(model, torch.rand(2, 1, 8, 8)), tmp_path / "f.onnx")
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(0).random((32, 1, 8, 8), "f4"))
    common = [str(tmp_path / "f.onnx"), "--calib", str(tmp_path / "calib.npz"), "--quiet"]
    common += ["--recipe", "int8_avx2"]  # ORT's fused u8 x s8 kernels are exact here (COMMON)
    assert main(["quantize", *common, "-o", str(tmp_path / "q.onnx")]) == 0
    assert (
        main(["quantize", *common, "-o", str(tmp_path / "qop.onnx"), "--format", "qoperator"]) == 0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "calib.npz",
        "f.onnx",
        "q.onnx",
        "qop.onnx",
    ]
    ops = collections.Counter(n.op_type for n in onnx.load(tmp_path / "qop.onnx").graph.node)
    assert ops["QLinearConv"] == 3 and ops["QGemm"] >= 1 and "Conv" not in ops, ops
    report = qb.onnx.inspect_model(tmp_path / "qop.onnx")
    assert report.form.startswith("QOperator") or report.form == "QDQ+QOperator"
    # the same model as the QDQ file, within 1 output step (float32 requantization in ORT)
    x = np.random.default_rng(1).random((16, 1, 8, 8), "f4")
    qdq, folded = _run(tmp_path / "q.onnx", x, optimize=False), _run(tmp_path / "qop.onnx", x)
    step = np.abs(np.diff(np.unique(qdq))).min()  # the output grid's step
    assert np.abs(folded - qdq).max() <= 1.001 * step


def test_inspect_fixed_point_of_an_onnx_file_and_of_a_program(tmp_path, capsys):
    torch.manual_seed(0)
    batches = [torch.rand(8, 1, 8, 8) for _ in range(2)]
    qmodel = qb.quantize(DigitsCNN().eval(), batches, recipe="pow2", progress=False)
    qb.export(qmodel, tmp_path / "m.onnx", example_inputs=batches[0])
    prog = qb.lower(tmp_path / "m.onnx")
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "m.onnx"), "--fixed-point"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("integer program:") and "fraction bits" in text
    assert f"requantizations: {len(qb.integer.requantizations(prog))}" in text
    assert "shift only" in text and "(acc * M) >> n" not in text  # pow2 scales: pure shifts

    assert (
        main(["lower", str(tmp_path / "m.onnx"), "--emit", "npz", "-o", str(tmp_path / "p.npz")])
        == 0
    )
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "p.npz"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tensors"] == prog.formats()
    convs = [r for r in doc["requantizations"] if r["op"] == "conv"]
    assert len(convs) == 3 and all(len(r["multipliers"]) == len(r["shifts"]) for r in convs)
    # multiplier / 2**shift is the scale ratio s_x s_w / s_y, exactly for power-of-two scales
    for r in convs:
        assert r["shift_only"] and all(m == 1 for m in r["multipliers"])


def test_float_outputs_are_refused_by_name_with_the_fix():
    """Outputs computed in float after the last quantized tensor (a float Sigmoid head, an
    unquantized Relu) are all named in one error, with the producing node and the fix."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.uint8), "z")]  # fmt: skip
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
        helper.make_node("Sigmoid", ["d"], ["prob"], name="head"),
        helper.make_node("Relu", ["d"], ["act"], name="relu"),
    ]
    outputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("prob", "act", "d")
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], outputs, inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    try:
        qb.lower(model, float_outputs="refuse")
    except qb.LoweringError as e:
        message = str(e)
    else:
        raise AssertionError("lower accepted float outputs")
    assert (
        "outputs 'prob' (from 'head', Sigmoid), 'act' (from 'relu', Relu) are not quantized"
        in message
    )
    assert "'d'" not in message  # a dequantized output is fine: the program dequantizes it
    assert "QuantizeLinear -> DequantizeLinear" in message
