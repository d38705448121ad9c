"""The ``quantbridge`` command: ``demo`` numbers, ``inspect`` output and errors, ``--version``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import subprocess
import sys

import pytest

from quantbridge import __version__
from quantbridge.cli import main
from quantbridge.demo import DemoResult
from quantbridge.recipe import native_preset


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One in-process ``quantbridge demo --epochs 2 --json`` run: (exit code, result dict, dir)."""
    out = tmp_path_factory.mktemp("demo")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["demo", "--epochs", "2", "--json", "--quiet", "--out", str(out)])
    return code, json.loads(stdout.getvalue()), out


def test_demo_two_epochs_numbers(demo_run):
    code, result, _ = demo_run
    assert result["epochs"] == 2 and result["recipe"] == native_preset()
    assert result["n_train"] + result["n_test"] == 1797
    assert result["float_accuracy"] > 0.85
    assert abs(result["int8_ort_accuracy"] - result["float_accuracy"]) <= 0.02
    assert abs(result["int8_torch_accuracy"] - result["float_accuracy"]) <= 0.02
    assert result["int8_onnx_bytes"] < result["float_onnx_bytes"]
    assert result["within_1_lsb"] >= 0.99
    assert result["argmax_agreement"] >= 0.99
    assert result["float_weights"] == []
    assert result["int8_ops"]["Conv"] == 3 and result["int8_ops"]["Gemm"] == 2
    assert result["latency_ms"]["ort_int8"] > 0 and result["latency_ms"]["ort_float"] > 0
    # qb.to_engine(qmodel) called as fast(x_test): the exported file's logits, bit for bit
    assert result["engine_matches_file"]
    assert result["engine_accuracy"] == result["int8_ort_accuracy"]
    # every check the demo prints holds on this run (the numbers above), so it says ok and exits 0
    assert len(result["checks"]) == 6 and all(v is True for v in result["checks"].values()), result
    assert result["ok"] is True and code == 0


def test_demo_result_says_no_when_a_check_fails(demo_run):
    """A Conv left in float (what an int8-symmetric recipe with ReLU gives in ONNX Runtime)."""
    _, result, _ = demo_run
    fields = {k: v for k, v in result.items() if k not in ("checks", "ok")}
    bad = DemoResult(**{**fields, "float_ops": {"Conv": 3}, "int8_onnx_bytes": 10**9})
    assert not bad.ok
    assert [name for name, ok in bad.checks.items() if not ok] == [
        "every Conv/Gemm of the INT8 file runs in int8",
        "INT8 file smaller than the float file",
    ]
    text = bad.format()
    assert "every Conv/Gemm of the INT8 file runs in int8: NO" in text
    assert "result: FAILED" in text and "LARGER" in text


def test_demo_keeps_files_in_out(demo_run):
    _, result, out = demo_run
    assert sorted(result["files"]) == ["float", "int8"]
    for path in result["files"].values():
        assert os.path.dirname(path) == str(out) and os.path.isfile(path)
    assert os.path.getsize(result["files"]["int8"]) == result["int8_onnx_bytes"]


def test_inspect_json_of_the_demo_file(demo_run, capsys):
    _, result, _ = demo_run
    assert main(["inspect", result["files"]["int8"], "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["float_weights"] == [] and report["form"] == "QDQ"
    assert report["int8_ops"]["Conv"] == 3


def test_inspect_text_of_the_float_file(demo_run, capsys):
    _, result, _ = demo_run
    assert main(["inspect", result["files"]["float"]]) == 0
    out = capsys.readouterr().out
    assert "form:      float" in out
    assert "float weights: " in out and "float weights: none" not in out


def test_inspect_missing_file_exits_2_with_one_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.onnx")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "missing.onnx" in captured.err
    assert "Traceback" not in captured.err


def test_inspect_not_onnx_exits_2(tmp_path, capsys):
    path = tmp_path / "notes.onnx"
    path.write_text("these are notes, not a model\n")
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not an ONNX model" in err and err.count("\n") == 1


def test_demo_unknown_recipe_exits_2_before_training(capsys):
    assert main(["demo", "--recipe", "int3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "int3" in err and "int8" in err and err.count("\n") == 1


def test_version_and_usage(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"quantbridge {__version__}"
    assert main([]) == 2
    assert main(["frobnicate"]) == 2


def test_python_dash_m(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quantbridge", "--version"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("quantbridge", run_name="__main__")
    assert done.value.code == 0 and __version__ in capsys.readouterr().out


@pytest.mark.slow
def test_full_demo_console_script():
    """The default run, as users start it: passes every check, quietly, in under two minutes."""
    script = os.path.join(os.path.dirname(sys.executable), "quantbridge")
    done = subprocess.run([script, "demo"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "result: OK" in done.stdout
    assert "INT8 accuracy within 0.5 points of float: yes" in done.stdout
    assert "epoch 8/8" in done.stderr
    assert "torchvision" not in done.stderr and "Warning" not in done.stderr
