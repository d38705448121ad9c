"""``quantbridge lower`` (thin over ``qb.lower`` and the emitters) and the npz round trip."""

from __future__ import annotations

import numpy as np
import onnx

import quantbridge as qb
from quantbridge.cli import main
from quantbridge.integer import load_npz, save_npz


def _model(qdq_graph, path):
    g = qdq_graph((1, 3, 6, 6))
    w = g.weight((4, 3, 3, 3))
    y = g.quant(g.node("Relu", [g.node("Conv", [g.x, w, g.bias(4, 0.001)])]), 0.05, 0)
    onnx.save(g.model(g.quant(g.node("Sigmoid", [y]), 0.004, 0)), path)
    return path


def test_cli_lower_emits_onnx_npz_c(qdq_graph, tmp_path, capsys):
    src = _model(qdq_graph, tmp_path / "m.onnx")
    assert main(["lower", str(src), "-o", str(tmp_path / "m.int.onnx")]) == 0
    integer = onnx.load(tmp_path / "m.int.onnx")
    assert "ConvInteger" in {n.op_type for n in integer.graph.node}
    assert main(["lower", str(src), "-o", str(tmp_path / "m.npz"), "--emit", "npz"]) == 0
    assert main(["lower", str(src), "--emit", "c", "--c-dir", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "qb_model.c").is_file() and (tmp_path / "c" / "qb_model.h").is_file()
    assert "conv" in capsys.readouterr().out


def test_cli_lower_errors_are_one_line(qdq_graph, tmp_path, capsys):
    assert main(["lower", str(tmp_path / "missing.onnx"), "-o", "x.onnx"]) == 2
    assert "no ONNX file" in capsys.readouterr().err
    src = _model(qdq_graph, tmp_path / "m.onnx")
    assert main(["lower", str(src), "--emit", "npz"]) == 2
    assert "needs -o OUT" in capsys.readouterr().err


def test_npz_round_trip_runs_identically(qdq_graph, tmp_path):
    prog = qb.lower(_model(qdq_graph, tmp_path / "m.onnx"))
    save_npz(prog, tmp_path / "p.npz")
    again = load_npz(tmp_path / "p.npz")
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 6)).astype(np.float32)
    a, b = prog.run(x, integer=True), again.run(x, integer=True)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert again.describe() == prog.describe()
