"""``lower`` boundary options: ``float_outputs="dequantize"`` (a float function of the last codes
as a table outside the program) and ``input_shapes`` (static sizes for dynamic inputs)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import quantbridge as qb
from quantbridge.integer import load_npz, save_npz


def ort_session(model) -> ort.InferenceSession:
    """The QDQ graph node by node (its own float arithmetic)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _tail_model(qdq_graph):
    """codes -> float: Sigmoid of the input's codes, and hard-swish ``x * HardSigmoid(x)``."""
    g = qdq_graph((2, 3, 4, 5), scale=0.04, zero=120)
    sig = g.node("Sigmoid", [g.x])
    swish = g.node("Mul", [g.x, g.node("HardSigmoid", [g.x], alpha=1 / 6, beta=0.5)])
    return g.model(sig, swish), (sig, swish)


def test_float_tail_is_refused_on_request_and_names_the_option(qdq_graph):
    # "refuse" was the default until qb.quantize's default recipe kept the logits float
    model, _ = _tail_model(qdq_graph)
    with pytest.raises(qb.LoweringError, match="not quantized.*float_outputs='dequantize'"):
        qb.lower(model, float_outputs="refuse")


def test_float_tail_as_a_table_agrees_with_onnx_runtime(qdq_graph, tmp_path):
    model, names = _tail_model(qdq_graph)
    prog = qb.lower(model, float_outputs="dequantize")
    assert all(b.table is not None and b.table.shape == (256,) for b in prog.outputs)
    x = np.random.default_rng(0).normal(0, 3, (2, 3, 4, 5)).astype(np.float32)
    got = prog.run({"x": x})
    expected = ort_session(model).run(list(names), {"x": x})
    for name, want in zip(names, expected, strict=True):
        assert got[name].dtype == np.float32
        # ORT computes in float32 (MLAS' sigmoid approximation); the table in float64, then
        # rounded to float32: a few float32 ulps apart on values below 6
        np.testing.assert_allclose(got[name], want, rtol=0, atol=2e-6)
    # the program itself ends at the codes: the integer ONNX and the npz keep them
    codes = prog.run({"x": x}, integer=True)
    assert all(np.issubdtype(v.dtype, np.integer) for v in codes.values())
    path = tmp_path / "p.npz"
    save_npz(prog, path)
    again = load_npz(path).run({"x": x})
    for name in names:
        np.testing.assert_array_equal(again[name], got[name])


def test_weighted_float_output_is_the_accumulator_with_dequantize(qdq_graph):
    """A weighted layer's float output: refused with ``float_outputs="refuse"`` (naming the
    option); with ``"dequantize"``, the default, the int32 accumulator and its per-channel scale
    (test_integer_accumulator_outputs.py checks the values)."""
    g = qdq_graph((1, 8))
    out = g.node("MatMul", [g.x, g.weight((8, 4), axis=1)])  # no QuantizeLinear after it
    with pytest.raises(qb.LoweringError, match="not quantized.*float_outputs='dequantize'"):
        qb.lower(g.model(out), float_outputs="refuse")
    for program in (qb.lower(g.model(out), float_outputs="dequantize"), qb.lower(g.model(out))):
        (b,) = program.outputs
        assert b.tensor.dtype == np.int32 and b.scale.shape == (4,) and b.axis == -1


def test_unknown_float_outputs_mode(qdq_graph):
    g = qdq_graph((1, 4))
    with pytest.raises(ValueError, match="float_outputs must be one of"):
        qb.lower(g.model(g.x), float_outputs="float")


def _mean_model(qdq_graph):
    g = qdq_graph(("N", 4, "H", "W"), scale=0.05, zero=10)
    mean = g.node("ReduceMean", [g.x, g.const(np.array([2, 3], np.int64))], keepdims=1)
    return g.model(g.quant(mean, 0.01, 128))


def test_input_shapes_lower_a_mean_over_dynamic_sizes(qdq_graph):
    model = _mean_model(qdq_graph)
    with pytest.raises(qb.LoweringError, match="need static sizes"):
        qb.lower(model)
    x = np.random.default_rng(1).uniform(-0.4, 12, (3, 4, 7, 9)).astype(np.float32)
    prog = qb.lower(model, input_shapes={"x": x.shape})
    (got,) = prog.run({"x": x}, integer=False).values()
    (want,) = ort_session(model).run(None, {"x": x})
    # float rescale (ORT) vs fixed-point multiplier and one rounding: at most 1 LSB (0.01)
    assert np.max(np.abs(got - want)) <= 0.01 + 1e-6


@pytest.mark.parametrize(
    ("shapes", "message"),
    [({"y": (1, 4, 2, 2)}, r"names \['y'\]; the graph's inputs are \['x'\]"),
     ({"x": (1, 4, 2)}, "has 3 dims; the input has 4"),
     ({"x": (1, 5, 2, 2)}, "conflicts with the input's static dimension 4")],
)  # fmt: skip
def test_bad_input_shapes(qdq_graph, shapes, message):
    with pytest.raises(ValueError, match=message):
        qb.lower(_mean_model(qdq_graph), input_shapes=shapes)


def test_float_weight_names_the_head_option(qdq_graph):
    """Regression: quantize_onnx's float head left the detector's ConvTranspose weight float,
    and the error did not say how to quantize it."""
    g = qdq_graph((1, 2, 4, 4))
    w = g.const(np.ones((2, 3, 2, 2), np.float32), "w")
    out = g.quant(g.node("ConvTranspose", [g.x, w]), 0.1, 0)
    with pytest.raises(qb.LoweringError, match="ConvTranspose .* left in float.*--int8-head"):
        qb.lower(g.model(out))


def test_cli_lower_with_float_outputs_and_input_shape(qdq_graph, tmp_path, capsys):
    from quantbridge.cli import main

    model, names = _tail_model(qdq_graph)
    src, dst = tmp_path / "tail.onnx", tmp_path / "tail.npz"
    src.write_bytes(model.SerializeToString())
    refuse = ["--float-outputs", "refuse"]
    assert main(["lower", str(src), "--emit", "npz", "-o", str(dst), *refuse]) != 0
    assert "float_outputs='dequantize'" in capsys.readouterr().err
    args = ["lower", str(src), "--emit", "npz", "-o", str(dst), "--float-outputs", "dequantize"]
    assert main([*args, "--input-shape", "x=2,3,4,5"]) == 0
    x = np.random.default_rng(2).normal(0, 3, (2, 3, 4, 5)).astype(np.float32)
    expected = qb.lower(model, float_outputs="dequantize").run({"x": x})
    got = load_npz(dst).run({"x": x})
    for name in names:
        np.testing.assert_array_equal(got[name], expected[name])
