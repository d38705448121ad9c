"""ReduceSum of codes, a constant's ReduceL2 (a weight norm), and a float function of codes
read by a LayerNorm: what WavLM's feature projection, positional conv and gated position
bias ask of ``lower`` (HF WavLM: "no integer lowering: ReduceL2, ReduceSum", 2026-12-02)."""

from __future__ import annotations

import numpy as np

import quantbridge as qb


def test_sum_then_sigmoid(qdq_graph, layerwise, three_emitters, tmp_path):
    """WavLM's gate ``sigmoid(linear(q).view(..., 2, 4).sum(-1))``: the sum of 4 codes goes on
    int16 codes of step 4 x range / 32767 (s / 64 here: half of it per sum, far below the
    sigmoid's 1/256 output step), then a 65536-entry table: within 1 LSB of ORT."""
    g = qdq_graph((2, 3, 2, 4), scale=0.05, zero=128)
    total = g.node("ReduceSum", [g.x, g.const(np.array([-1], np.int64))], keepdims=0)
    model = g.model(g.quant(g.node("Sigmoid", [total]), 1 / 256, 0))
    feeds = {"x": np.random.default_rng(2).normal(0, 2, (2, 3, 2, 4)).astype(np.float32)}
    prog = qb.lower(model)
    assert set(prog.op_counts()) == {"reduce_mean", "lut"}
    diffs = layerwise(model, prog, feeds)
    assert len(diffs) == 1 and max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)


def test_weight_norm_of_a_constant_folds(qdq_graph, layerwise):
    """``weight = g * v / ||v||`` computed in the graph on float constants (torch's
    weight_norm parametrization, WavLM's positional conv), then quantized: folded to the
    weight's codes at lowering, the same float32 arithmetic as ORT: 0 LSB."""
    g = qdq_graph((2, 6), scale=0.05, zero=128)
    v = g.const(g.rng.normal(0, 1, (6, 3)).astype(np.float32))
    gain = g.const(g.rng.uniform(0.5, 1.5, (1, 3)).astype(np.float32))
    norm = g.node("ReduceL2", [v, g.const(np.array([0], np.int64))], keepdims=1)
    w = g.quant(g.node("Mul", [v, g.node("Div", [gain, norm])]), 0.01, 0, np.int8)
    model = g.model(g.quant(g.node("MatMul", [g.x, w]), 0.05, 128))
    feeds = {"x": np.random.default_rng(2).normal(0, 2, (2, 6)).astype(np.float32)}
    prog = qb.lower(model)
    diffs = layerwise(model, prog, feeds)
    assert max(int(d.max()) for d in diffs.values()) == 0


def test_layer_norm_of_a_gelu(qdq_graph, layerwise, three_emitters, tmp_path):
    """wav2vec2 / WavLM: conv -> GELU (no QuantizeLinear) -> Transpose -> LayerNorm. The GELU
    is a table to int16 codes of max |gelu| / 32767 (half of it per element against a row
    spread of ~1), then the integer layer norm: within 1 LSB of ORT."""
    g = qdq_graph((2, 8, 5), scale=0.05, zero=128)
    erf = g.node("Erf", [g.node("Div", [g.x, g.const(np.float32(np.sqrt(2)))])])
    gelu = g.node("Mul", [g.node("Mul", [g.x, g.node("Add", [erf, g.const(np.float32(1))])]),
                          g.const(np.float32(0.5))])  # fmt: skip
    moved = g.node("Transpose", [gelu], perm=[0, 2, 1])
    gamma = g.const(g.rng.uniform(0.5, 1.5, 8).astype(np.float32))
    beta = g.const(g.rng.normal(0, 0.2, 8).astype(np.float32))
    model = g.model(g.quant(g.node("LayerNormalization", [moved, gamma, beta]), 0.03, 128))
    feeds = {"x": np.random.default_rng(5).normal(0, 2, (2, 8, 5)).astype(np.float32)}
    prog = qb.lower(model)
    assert {"lut", "layernorm"} <= set(prog.op_counts())
    diffs = layerwise(model, prog, feeds)
    assert len(diffs) == 1 and max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)
