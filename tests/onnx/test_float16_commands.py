"""``lower``, ``fold``, ``inspect`` and ``compare`` on float16 quantized files (ModelOpt's default
mode). Before the fix ``lower`` refused the file's Casts ("no integer lowering: Cast"), ``fold``
left every op in QDQ form, ``inspect`` did not say the file computes in float16, and the CLI
printed the float16 warning once per engine as ``sys:1: Float16GraphWarning``. Now the file is
read as float32 (grids exact, its float-to-float Casts as Identity), so each command does what it
does on the same file stored in float32.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from float16_files import Y_SCALE, conv_file

import quantbridge as qb
from quantbridge.cli import main
from quantbridge.onnx.importer._fp16 import Float16GraphWarning

X = np.random.default_rng(1).uniform(-4, 4, (2, 3, 6, 6)).astype(np.float32)
Y_STEP, Y_ZERO = float(np.float16(Y_SCALE)), -128  # the file's output grid


def _ort(model, optimize: bool = False) -> np.ndarray:
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"x": X})[0]


def test_lower_gives_the_float32_files_program():
    with pytest.warns(Float16GraphWarning, match="in_cast"):
        program = qb.lower(conv_file())
    codes = program.run({"x": X}, integer=True)["y"]
    # the same grids: the program of the float32 twin, code for code
    assert np.array_equal(codes, qb.lower(conv_file(np.float32)).run({"x": X}, integer=True)["y"])
    # ONNX Runtime on the float32 twin: float requantization vs the fixed-point multiplier,
    # at most 1 LSB by design (measured 0)
    twin = np.round(_ort(conv_file(np.float32)) / Y_STEP) + Y_ZERO
    assert np.abs(codes - twin).max() <= 1
    # on the float16 file itself: its conv sums and requantization in float16 move a code across
    # a rounding threshold at most one step (measured: max 1 LSB, 38% of the float outputs differ)
    own = np.round(_ort(conv_file()).astype(np.float64) / Y_STEP) + Y_ZERO
    assert np.abs(codes - own).max() <= 1


def test_fold_gives_the_float32_files_qoperator_model():
    with pytest.warns(Float16GraphWarning):
        folded = qb.onnx.fold(conv_file())
    ops = [n.op_type for n in folded.graph.node]
    assert ops == ["QuantizeLinear", "Identity", "QLinearConv", "Identity", "DequantizeLinear"]
    twin = qb.onnx.fold(conv_file(np.float32))
    assert np.array_equal(_ort(folded, optimize=True), _ort(twin, optimize=True))


def test_cli_commands_on_a_float16_file(tmp_path, capsys):
    path = tmp_path / "fp16.onnx"
    path.write_bytes(conv_file().SerializeToString())
    assert main(["inspect", str(path)]) == 0
    assert "float16:   the graph computes in float16" in capsys.readouterr().out
    assert main(["lower", str(path), "-o", str(tmp_path / "int.onnx")]) == 0
    err = capsys.readouterr().err
    assert err.count("quantbridge lower: warning: the ONNX file computes in float16") == 1
    assert "sys:1" not in err
    assert main(["fold", str(path), "-o", str(tmp_path / "qop.onnx")]) == 0
    assert "QLinearConv 1" in capsys.readouterr().out
    samples = tmp_path / "x.npz"
    np.savez(samples, x=X)
    engines = "ort-ref,torch-quant,integer"
    assert main(["compare", str(path), "--inputs", str(samples), "--engines", engines]) == 0
    captured = capsys.readouterr()
    # the file is imported once per torch engine and lowered once: one warning line
    assert captured.err.count("warning: the ONNX file computes in float16") == 1
    assert "failed" not in captured.out and "first divergence: none" in captured.out
