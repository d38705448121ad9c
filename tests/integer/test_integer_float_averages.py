"""A mean or average pool of a float result that no QuantizeLinear follows (``lowering._pool``):
the float result is realized on symmetric int16 codes first, the mean is a float graph output on
an int16 grid dequantized outside the program (``lowering._outputs``). Swin's pooler (the mean
of its final layer norm), EfficientNet's (an average pool of a SiLU), with every recipe."""

from __future__ import annotations

import numpy as np
import pytest

import quantbridge as qb


def _step(prog, name: str) -> float:
    (boundary,) = [b for b in prog.outputs if b.name == name]
    assert boundary.tensor.dtype == np.int16
    return boundary.tensor.scale


def test_mean_of_a_final_layer_norm(qdq_graph, node_by_node, three_emitters, tmp_path):
    """HF Swin: ``last_hidden_state = LayerNorm(x)`` and ``pooler_output = mean over tokens of
    it`` (Transpose -> ReduceMean), both float outputs. Before: "ReduceMean: its input is an
    unquantized float result" with the default and the int8 recipe alike (2026-12-02). The norm
    is realized once per reader on the int16 grid of its bound ``max |gamma| sqrt(N) + |beta|``;
    the mean's bound is the same, so its output step equals the norm's. Each norm value is within
    half a step (plus the kernel's 2**-16 fixed-point error) of ORT's, its mean too, and the mean
    rounds once more: within one step of ORT's float mean."""
    g = qdq_graph((2, 6, 8), scale=0.05, zero=128)
    gamma = g.const(np.linspace(0.5, 1.5, 8).astype(np.float32))
    beta = g.const(np.linspace(-0.2, 0.3, 8).astype(np.float32))
    normed = g.node("LayerNormalization", [g.x, gamma, beta], axis=-1, epsilon=1e-5)
    tokens_last = g.node("Transpose", [normed], perm=[0, 2, 1])
    pooled = g.node("ReduceMean", [tokens_last, g.const(np.array([2], np.int64))], keepdims=0)
    model = g.model(normed, pooled)
    x = np.random.default_rng(1).normal(0, 2, (2, 6, 8)).astype(np.float32)
    prog = qb.lower(model)
    got = prog.run({"x": x})
    ref_normed, ref_pooled = node_by_node(model).run(None, {"x": x})
    step = _step(prog, pooled)
    # the mean's bound counts the int16 code -32768: 32768 / 32767 of the norm's step
    assert step == pytest.approx((1.5 * np.sqrt(8) + 0.3) / 32767, rel=4e-5)
    assert got[pooled].shape == ref_pooled.shape == (2, 8)
    assert np.abs(got[pooled].astype(np.float64) - ref_pooled).max() <= step
    assert np.abs(got[normed].astype(np.float64) - ref_normed).max() <= _step(prog, normed)
    three_emitters(prog, {"x": x}, tmp_path)


@pytest.mark.parametrize("op", ["AveragePool", "GlobalAveragePool"])
def test_average_pool_of_a_silu(qdq_graph, node_by_node, three_emitters, tmp_path, op):
    """HF EfficientNet: ``AveragePool(x * sigmoid(x))`` of the last block's SiLU, a float output
    (the SiLU has no QuantizeLinear: only the pool reads it). Before: "AveragePool: its input is
    an unquantized float function" (2026-12-02). The SiLU is a table from the 8-bit codes onto
    the int16 grid of its largest value ``max |silu(s (q - z))|`` (half a step of rounding);
    the pool's bound is that value, so its output step is the same: within one step of ORT.
    The padded 3 x 3 windows (padding excluded) check the integer ONNX's int16 window sums
    (two byte-wise ConvInteger sums, padded with their zero points)."""
    g = qdq_graph((2, 4, 6, 6), scale=0.04, zero=100)
    silu = g.node("Mul", [g.x, g.node("Sigmoid", [g.x])])
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    attrs = attrs if op == "AveragePool" else {}
    pooled = g.node(op, [silu], **attrs)
    model = g.model(pooled)
    x = np.random.default_rng(2).normal(0, 2, (2, 4, 6, 6)).astype(np.float32)
    prog = qb.lower(model)
    (got,) = prog.run({"x": x}).values()
    (ref,) = node_by_node(model).run(None, {"x": x})
    r = (np.arange(256) - 100) * np.float64(np.float32(0.04))
    step = _step(prog, pooled)
    assert step == pytest.approx(np.max(np.abs(r / (1 + np.exp(-r)))) / 32767, rel=4e-5)
    assert got.shape == ref.shape
    assert np.abs(got.astype(np.float64) - ref).max() <= step
    three_emitters(prog, {"x": x}, tmp_path)


def test_refused_float_output_says_what_quantize_outputs_covers(qdq_graph):
    """The refusal said that recipe='int8' places an output quantizer; it does for a weighted
    or arithmetic layer's output only, not after a norm or a pool (checked 2026-12-02 on Swin,
    EfficientNet, LeViT): the message says so."""
    g = qdq_graph((2, 6, 8), scale=0.05, zero=128)
    one, zero = g.const(np.ones(8, np.float32)), g.const(np.zeros(8, np.float32))
    model = g.model(g.node("LayerNormalization", [g.x, one, zero], axis=-1))
    with pytest.raises(qb.LoweringError, match=r"weighted or arithmetic layer .* not one "
                       r"written by another float op \(a norm, a pool"):  # fmt: skip
        qb.lower(model, float_outputs="refuse")
