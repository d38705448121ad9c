"""ReduceMax / ReduceMin lowered on codes: exact against ONNX Runtime (0 LSB, since
``r = s(q - z)`` is increasing in ``q``), the three emitters bit-exact with each other."""

from __future__ import annotations

import numpy as np

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


def test_max_of_a_float_function_is_tabled_first(qdq_graph, layerwise, three_emitters, tmp_path):
    """dpn48b's stem: SiLU -> MaxPool (3x3, stride 2, padded) -> Q, and a ReduceMax of SiLU.
    Before (2026-12-02): "MaxPool ...: takes the max / min of a float function of codes that
    is not increasing" (and a regression before that: the SiLU moved after the max, 7 LSB off).
    SiLU is not monotone, but quantization is, so the program tables SiLU onto the Q's grid and
    takes the max of those codes. The table is SiLU in float64 rounded once, ORT rounds its
    float32 SiLU once: at most 1 LSB, where the two sit on either side of a rounding tie."""
    g = qdq_graph((2, 3, 6, 6), scale=0.05, zero=128)  # codes down to -6.4: SiLU not monotone
    silu = g.node("Mul", [g.x, g.node("Sigmoid", [g.x])])
    pooled = g.node("MaxPool", [silu], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    reduced = g.node("ReduceMax", [silu, _axes(g, [-1])], keepdims=1)
    model = g.model(g.quant(pooled, 0.02, 10), g.quant(reduced, 0.03, 12))
    x = np.random.default_rng(7).normal(-1, 2, (2, 3, 6, 6)).astype(np.float32)
    prog = qb.lower(model)
    assert {"lut", "maxpool", "reduce_max"} <= set(prog.op_counts())
    diffs = layerwise(model, prog, {"x": x})
    assert len(diffs) == 2 and all(int(d.max()) <= 1 for d in diffs.values()), diffs
    three_emitters(prog, {"x": x}, tmp_path)


def test_maxpool_of_sigmoid_stays_exact(qdq_graph, layerwise):
    """An increasing function (Sigmoid) still moves through the max: 0 LSB against ORT."""
    g = qdq_graph((1, 2, 4, 4), scale=0.05, zero=128)
    pooled = g.node("MaxPool", [g.node("Sigmoid", [g.x])], kernel_shape=[2, 2], strides=[2, 2])
    model = g.model(g.quant(pooled, 1 / 256, 0))
    x = np.random.default_rng(6).normal(0, 2, (1, 2, 4, 4)).astype(np.float32)
    assert all(int(d.max()) == 0 for d in layerwise(model, qb.lower(model), {"x": x}).values())
