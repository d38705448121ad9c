"""OpenVINO 2026.4's ``compile_model`` dies with a segmentation fault on ``Concat ->
QuantizeLinear -> DequantizeLinear -> QuantizeLinear`` (bisected from the HF DeiT / AST / YOLOS /
DPT / TimeSformer exports of session 13's sweep, where ``cat([cls, patches]) +
position_embeddings`` adds zeros that OpenVINO removes first) when OpenVINO reads the file
(``compile_model(path)``). ``openvino_crash_site`` finds it, the OpenVINO layout of it compiles,
``qb.to_engine`` (which compiles the bytes) runs it, and ``compare``, whose extra outputs make
the DeiT file crash from bytes too, reports a crash as the openvino engine's failure.

Every OpenVINO compile of the pattern runs in a child process (``_compile_in_child``): a
regression would crash that child, not the test run."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

ov = pytest.importorskip("openvino")

import onnx  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import quantbridge as qb  # noqa: E402
from quantbridge.onnx.passes._openvino import openvino_crash_site  # noqa: E402


def _pattern(between: str | None = "Add", pos: float = 0.0) -> onnx.ModelProto:
    """x -> Concat(x, x) -> Q -> DQ [-> Add(0)] -> Q -> DQ -> y: the smallest file that crashes."""
    inits = [
        numpy_helper.from_array(np.array(0.0086, np.float32), "s"),
        numpy_helper.from_array(np.array(127, np.uint8), "z"),
        numpy_helper.from_array(np.full((1, 1, 8), pos, np.float32), "pos"),
    ]
    nodes = [
        helper.make_node("Concat", ["x", "x"], ["cat"], axis=1, name="the_cat"),
        helper.make_node("QuantizeLinear", ["cat", "s", "z"], ["q1"]),
        helper.make_node("DequantizeLinear", ["q1", "s", "z"], ["d1"]),
    ]
    last = "d1"
    if between == "Add":
        nodes.append(helper.make_node("Add", ["d1", "pos"], ["added"]))
        last = "added"
    nodes += [
        helper.make_node("QuantizeLinear", [last, "s", "z"], ["q2"]),
        helper.make_node("DequantizeLinear", ["q2", "s", "z"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "ov_crash",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _compile_in_child(model) -> int:
    """The exit status of a child compiling ``model`` (a path: OpenVINO reads the file)."""
    if isinstance(model, onnx.ModelProto):
        code = (
            "import io, sys, openvino as ov; ov.Core().compile_model("
            "ov.convert_model(io.BytesIO(sys.stdin.buffer.read())), 'CPU')"
        )
        data = model.SerializeToString()
        return subprocess.run([sys.executable, "-c", code], input=data, check=False).returncode
    code = f"import openvino as ov; ov.Core().compile_model({str(model)!r}, 'CPU')"
    return subprocess.run([sys.executable, "-c", code], check=False).returncode


@pytest.mark.parametrize("between", ["Add", None])
def test_the_pattern_is_found(between):
    assert openvino_crash_site(_pattern(between)) == "the_cat"


def test_a_nonzero_add_is_not_the_pattern():
    assert openvino_crash_site(_pattern("Add", pos=0.5)) is None


def test_to_engine_runs_the_file_and_its_openvino_layout(tmp_path):
    model = _pattern()
    path = tmp_path / "crash.onnx"
    onnx.save(model, path)
    assert _compile_in_child(path) == -11  # OpenVINO reading the file itself: the crash
    laid = qb.openvino_layout(model)
    assert openvino_crash_site(laid) is None
    assert _compile_in_child(laid) == 0
    # to_engine compiles the bytes (convert_model), which OpenVINO 2026.4 survives on this file;
    # the inner pair re-rounds to the same grid, so both layouts equal ORT's unfused reference
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(2, 4, 8)).astype(np.float32))
    ref = qb.to_engine(path, "onnxruntime", optimization="disable")(x).numpy()
    for layout in (None, "openvino"):
        y = qb.to_engine(path, "openvino", layout=layout)(x).numpy()
        np.testing.assert_allclose(y, ref, atol=0.0086 * 1.01)  # at most one step of the grid


def test_compare_reports_the_pattern_as_the_engines_failure():
    x = np.random.default_rng(0).normal(size=(2, 4, 8)).astype(np.float32)
    result = qb.debug.compare(_pattern(), inputs={"x": x}, engines=["ort-ref", "openvino"])
    assert "'the_cat'" in result.errors["openvino"], result.errors
    assert "ort-ref" not in result.errors


def test_compare_reports_a_crash_as_the_engines_failure(monkeypatch):
    # a crash outside the known pattern (the child compiling the file is made to crash): no file
    # of a few nodes crashes OpenVINO's compile from bytes (DeiT with compare's outputs does)
    from quantbridge.debug import _engines

    monkeypatch.setenv("QB_COMPARE_OPENVINO_CHILD", "1")
    monkeypatch.setattr(_engines, "_PROBE", "import os, signal; os.kill(os.getpid(), 11)")
    x = np.random.default_rng(0).normal(size=(2, 4, 8)).astype(np.float32)
    result = qb.debug.compare(
        _pattern("Add", pos=0.5), inputs={"x": x}, engines=["ort-ref", "openvino"]
    )
    assert "signal 11" in result.errors["openvino"], result.errors
    assert "ort-ref" not in result.errors
