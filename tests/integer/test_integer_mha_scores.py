"""Issue 10: attention whose scores reach the Softmax unquantized lowers to an integer-only
program, with the QDQ model unchanged.

``nn.MultiheadAttention(need_weights=True)`` (its default) computes ``softmax(bmm(q * scale,
k^T))``: the product feeds only the softmax, so placement leaves it float (ORT runs it as an
integer MatMul with a float output), and there are no 8-bit score codes for the softmax table.
The lowering requantizes the int32 accumulator inside the program to int16 codes of a fine grid
(``lowering._normalize.SCORE_STEP``) and the exp table stops where its entries round to 0
(``kernels._normalize.softmax`` clamps the code difference to the table). Checked here: the
program's numbers against ORT (node by node, float scores and softmax) layer by layer, the three
emitters, ``integer_mode``, and the softmax kernel on wide codes against float64.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantbridge as qb
from quantbridge.integer.kernels._normalize import softmax

SHAPE = (2, 8, 32)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        return self.head(self.att(x, x, x)[0])  # need_weights=True: the default


@pytest.fixture(scope="module")
def attention(tmp_path_factory):
    path = tmp_path_factory.mktemp("mha") / "mha.onnx"
    torch.manual_seed(0)
    model = Attention().eval()
    qmodel = qb.quantize(model, [torch.randn(*SHAPE) for _ in range(4)], recipe="int8",
                         progress=False)  # fmt: skip
    with warnings.catch_warnings():  # without VNNI: the engine-saturation warning (ORT runs
        warnings.simplefilter("ignore")  # node by node here, exact with any weights)
        qb.export(qmodel, path, example_inputs=torch.zeros(*SHAPE))
    return qmodel, onnx.load(path), qb.lower(path)


def _inputs(seed: int, batch: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, *SHAPE[1:])).astype(np.float32)


def test_scores_are_float_in_the_model_and_int16_in_the_program(attention):
    _, model, prog = attention
    producer = {o: n for n in model.graph.node for o in n.output}
    (softmax_node,) = [n for n in model.graph.node if n.op_type == "Softmax"]
    assert producer[softmax_node.input[0]].op_type == "MatMul"  # no QuantizeLinear between
    (step,) = [s for s in prog.steps if s.op == "softmax"]
    scores = prog.tensors[step.inputs[0]]
    assert scores.dtype == np.int16 and scores.scale >= 2.0**-10
    table = step.attrs["table"]
    assert len(table) < 2**16 and table[-1] == 0 and table[-2] > 0  # stops at the first 0
    assert all(np.dtype(t.dtype).kind in "iu" for t in prog.tensors.values())


def test_three_emitters_identical(attention, three_emitters, tmp_path):
    _, _, prog = attention
    x = _inputs(1, batch=2) * 3  # beyond the calibrated range: saturation paths
    three_emitters(prog, {"x": x}, tmp_path, integer_only=False)


def test_agrees_with_onnx_runtime_layer_by_layer(attention, layerwise):
    """ORT computes each quantized tensor from the program's own input codes, with float scores
    and a float softmax. The program's scores are the exact accumulator on a 2**-10 grid and its
    probabilities int16 codes of 2**-15: both far below half a code of P @ V, so only ties move
    a code, by 1. Measured: least exact tensor (P @ V) 99.3% (2**-8 scores: 97.8%).
    Asserted: max 1 LSB everywhere, >= 98.5% exact for every tensor (margin for ties that
    another ORT build rounds the other way)."""
    _, model, prog = attention
    diffs = layerwise(model, prog, {"x": _inputs(2, batch=16)})
    worst = min((d == 0).mean() for d in diffs.values())
    every = np.concatenate([d.reshape(-1) for d in diffs.values()])
    print(f"\nlayer-wise: {len(diffs)} quantized tensors, max {every.max()} LSB, "
          f"least exact tensor {worst:.2%}")  # fmt: skip
    assert every.max() <= 1 and worst >= 0.985


def test_integer_mode_is_the_program(attention):
    qmodel, _, prog = attention
    x = torch.from_numpy(_inputs(3, batch=4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with qb.integer_mode(qmodel):
            got = qmodel(x)
    expected = prog.run({"x": x.numpy()})[prog.outputs[0].name]
    np.testing.assert_array_equal(got.numpy(), expected)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 64), st.sampled_from([2.0**-10, 2.0**-6, 0.05]))
def test_softmax_on_wide_codes_matches_float64(seed, k, beta):
    """int16 codes over their whole range, the table cut where its entries round to 0: each
    probability within ``1 + (k + 1) / 4`` codes of ``2**15 softmax(beta q)`` (table entries are
    within 1/2 of ``2**16 exp``, the sum within ``k / 2`` of its exact value, which is at least
    ``2**16``; one final rounding)."""
    rng = np.random.default_rng(seed)
    spread = rng.choice([30, 3000, 32767])
    q = rng.integers(-spread, spread + 1, size=(3, k)).astype(np.int16)
    reach = math.floor(17 * math.log(2) / beta) + 2
    d = np.arange(min(2**16, reach), dtype=np.float64)
    table = np.rint(np.exp(-beta * d) * 2**16).astype(np.int64)
    got = softmax({"table": table}, q).astype(np.float64)
    r = beta * q.astype(np.float64)
    e = np.exp(r - r.max(axis=-1, keepdims=True))
    exact = 2**15 * e / e.sum(axis=-1, keepdims=True)
    assert np.abs(got - np.minimum(exact, 2**15 - 1)).max() <= 1 + (k + 1) / 4


@pytest.mark.parametrize("bias", ["constant", "tensor"])
def test_scores_plus_a_position_bias(qdq_graph, layerwise, three_emitters, tmp_path, bias):
    """Swin / BEiT: ``softmax(DQ(scores) + relative_position_bias)``, here with a shifted-window
    mask of -100 folded into the constant (HF Swin, 2026-12-02: "Softmax: its input must be a
    dequantized 8-bit tensor"). The sum is requantized to int16 codes of max(2**-10, bound /
    32767) real units, here 0.0034 (bound: 0.08 x 128 + max |bias| = 112): half a step of
    error per score, a relative 0.17% on each exp, far below the 1/256 output step; then the
    exp table of code differences: within 1 LSB of ORT's float softmax (measured: all exact).
    A bias computed at run time and quantized (DeBERTa / T5-style) takes the same path."""
    g = qdq_graph((2, 2, 4, 4), scale=0.08, zero=128)
    table = g.rng.normal(0, 2, (1, 2, 4, 4)).astype(np.float32)
    table[..., 3] -= 100.0  # the shifted window's mask
    added = g.const(table) if bias == "constant" else g.quant(g.node("Relu", [g.x]), 0.05, 0)
    scores = g.node("Add", [g.x, added])
    model = g.model(g.quant(g.node("Softmax", [scores], axis=-1), 1 / 256, 0))
    feeds = {"x": np.random.default_rng(3).normal(0, 3, (2, 2, 4, 4)).astype(np.float32)}
    prog = qb.lower(model)
    assert {"rescale_sum", "softmax"} <= set(prog.op_counts())
    diffs = layerwise(model, prog, feeds)
    assert max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)


def test_matmul_scores_plus_a_quantized_bias(qdq_graph, layerwise, three_emitters, tmp_path):
    """WavLM's ``baddbmm(gated_position_bias, q, k^T) -> Softmax``: the scores' MatMul has no
    QuantizeLinear; before: "Add: operands must be quantized tensors" (HF WavLM, 2026-12-02).
    The int32 accumulator goes on int16 codes of one accumulator unit where it fits, else of
    bound / 32767 (here 8 x 128 x 128 = 131072 units: 4 units = 0.01 real, half of it per
    score), then the sum with the bias and the Softmax's int16 score grid: within 1 LSB of
    ORT."""
    g = qdq_graph((2, 2, 4, 8), scale=0.05, zero=128)
    k = g.quant(g.node("Transpose", [g.x], perm=[0, 1, 3, 2]), 0.05, 128)
    scores = g.node("MatMul", [g.x, k])
    bias = g.quant(g.node("Slice", [g.x, g.const(np.array([0])), g.const(np.array([4])),
                                    g.const(np.array([3]))]), 0.05, 128)  # fmt: skip
    model = g.model(g.quant(g.node("Softmax", [g.node("Add", [scores, bias])]), 1 / 256, 0))
    feeds = {"x": np.random.default_rng(3).normal(0, 1, (2, 2, 4, 8)).astype(np.float32)}
    prog = qb.lower(model)
    assert {"matmul", "rescale_sum", "softmax"} <= set(prog.op_counts())
    diffs = layerwise(model, prog, feeds)
    assert max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)
