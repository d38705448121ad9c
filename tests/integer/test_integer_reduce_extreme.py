"""ReduceMax / ReduceMin lowered on codes: exact against ONNX Runtime (0 LSB, since
``r = s(q - z)`` is increasing in ``q``), the three emitters bit-exact with each other."""

from __future__ import annotations

import numpy as np
import pytest

import quantbridge as qb


def _axes(g, axes):
    return g.const(np.array(axes, np.int64))


def test_reduce_max_min_match_ort_exactly(qdq_graph, layerwise, three_emitters, tmp_path):
    g = qdq_graph((2, 3, 4, 5), scale=0.05, zero=128)
    # a quantized tensor, a pending Conv (reduced after its requantization), every axis
    last = g.quant(g.node("ReduceMax", [g.x, _axes(g, [-1])], keepdims=1), 0.05, 128)
    inner = g.quant(g.node("ReduceMin", [g.x, _axes(g, [1, 2])], keepdims=0), 0.05, 128)
    w, bias = g.weight((4, 3, 3, 3)), g.bias(4, 0.05 * 0.02)
    conv = g.node("Conv", [g.x, w, bias], pads=[1, 1, 1, 1])
    channels = g.quant(g.node("ReduceMax", [conv, _axes(g, [1])], keepdims=1), 0.08, 120)
    everything = g.quant(g.node("ReduceMin", [g.x], keepdims=0), 0.05, 128)
    model = g.model(last, inner, channels, everything)
    x = np.random.default_rng(3).normal(0, 2, (2, 3, 4, 5)).astype(np.float32)
    prog = qb.lower(model)
    assert {"reduce_max", "reduce_min"} <= set(prog.op_counts())
    diffs = layerwise(model, prog, {"x": x})
    assert len(diffs) == 4 and all(int(d.max()) == 0 for d in diffs.values())
    shapes = [v.shape for v in prog.run({"x": x}).values()]
    assert shapes == [(2, 3, 4, 1), (2, 5), (2, 1, 4, 5), ()]
    three_emitters(prog, {"x": x}, tmp_path)


def test_reduce_max_of_a_float_function_names_the_fix(qdq_graph):
    g = qdq_graph((1, 4, 6))
    silu = g.node("Mul", [g.x, g.node("Sigmoid", [g.x])])  # not monotone: max(f(q)) != f(max q)
    model = g.model(g.quant(g.node("ReduceMax", [silu, _axes(g, [-1])]), 0.05, 128))
    with pytest.raises(qb.LoweringError, match=r"ReduceMax .*quantize that function's output"):
        qb.lower(model)
