"""Integer division (``kernels._divide``): L2 normalization (``F.normalize``'s ReduceL2 ->
Clip(eps) -> Expand -> Div, ONNX LpNormalization), the L2 norm itself, convnextv2's GRN
``||x|| / (mean ||x|| + eps)`` and the quotient of two quantized tensors, on hand-built QDQ
graphs against ONNX Runtime node by node and a float64 recomputation, the C and integer-ONNX
emitters bit-exact with the numpy executor; division by a zero code saturates as the float
model's +-inf does."""

from __future__ import annotations

import numpy as np
import pytest

import quantbridge as qb
from quantbridge.numerics import dequantize, quantize


def _normalized(g, x: str, axis: int) -> str:
    """``F.normalize(x, dim=axis)`` as torch exports it (float, no QuantizeLinear)."""
    norm = g.node("ReduceL2", [x, g.const(np.array([axis], np.int64))], keepdims=1)
    clamped = g.node("Clip", [norm, g.const(np.float32(1e-12))])
    return g.node("Div", [x, g.node("Expand", [clamped, g.node("Shape", [x])])])


def _normalize(axis: int):
    def build(g):
        return g.quant(_normalized(g, g.x, axis), 1 / 127, 0, np.int8)

    return build


def _cosine_scores(g):
    """swinv2_cr's cosine attention: ``F.normalize(q) @ F.normalize(k)^T``, both float (what
    qb.export writes), the scores quantized."""
    k = g.quant(g.node("Sin", [g.x]), 0.01, 128)
    kt = g.node("Transpose", [_normalized(g, k, -1)], perm=[0, 2, 1])
    return g.quant(g.node("MatMul", [_normalized(g, g.x, -1), kt]), 1 / 127, 0, np.int8)


def _lp_normalization(g):
    return g.quant(g.node("LpNormalization", [g.x], axis=-1, p=2), 1 / 127, 0, np.int8)


def _norm_then_q(g):
    norm = g.node("ReduceL2", [g.x, g.const(np.array([-1], np.int64))], keepdims=0)
    return g.quant(norm, 0.05, 0)


def _grn(g):
    """timm's GlobalResponseNorm (channels last): ``g = ||x||`` over H, W, ``g / (mean_c g +
    1e-6)``; the norm and the mean stay float (what qb.export writes)."""
    norm = g.node("ReduceL2", [g.x, g.const(np.array([1, 2], np.int64))], keepdims=1)
    mean = g.node("ReduceMean", [norm, g.const(np.array([-1], np.int64))], keepdims=1)
    shifted = g.node("Add", [mean, g.const(np.float32(1e-6))])
    return g.quant(g.node("Div", [norm, shifted]), 0.01, 0)


CASES = {  # name: (build, input shape)
    "normalize_channels": (_normalize(1), (2, 8, 4, 4)),
    "normalize_last": (_normalize(-1), (3, 6, 16)),
    "lp_normalization": (_lp_normalization, (3, 6, 16)),
    "l2_norm": (_norm_then_q, (3, 6, 16)),
    "grn": (_grn, (2, 4, 4, 64)),
    "cosine_scores": (_cosine_scores, (2, 6, 16)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_divisions_agree_with_ort_and_emitters(name, qdq_graph, three_emitters, tmp_path):
    """Within 1 LSB of ONNX Runtime's float32 QDQ graph, >= 97% exact: the kernels round once
    (the norms' isqrt floor and the multiplier are ~2**-30 relative, far below half a code),
    so a code differs only where float32 rounding moves a value across a rounding boundary;
    GRN's norm and mean (float in the QDQ graph) go on int16 codes first (~2**-13 relative:
    ~0.01 of an output code here), and the unit vectors of cosine attention on int16 codes of
    ``1 / top`` (``top = isqrt(2**31 / K)``: the int32 accumulator; ~2**-13 per element).
    Measured: 0 LSB for the normalizations and the norm, max 1 LSB for GRN and the cosine
    scores."""
    build, shape = CASES[name]
    g = qdq_graph(shape, scale=0.0437, zero=120)
    model = g.model(build(g))
    prog = qb.lower(model)
    x = (np.random.default_rng(1).standard_normal(shape) * 2).astype(np.float32)
    got = prog.run({"x": x}, integer=True)[prog.outputs[0].name].astype(np.int64)
    out = prog.outputs[0].tensor
    ref = g_ref = _node_by_node(model, x)
    lsb = np.abs(got - (np.rint(g_ref / out.scale) + out.zero_point))
    assert lsb.max() <= 1 and (lsb == 0).mean() >= 0.97, (name, lsb.max(), (lsb == 0).mean())
    assert ref.shape == got.shape
    three_emitters(prog, {"x": x}, tmp_path)


def _node_by_node(model, x):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("axis", [1, -1])
def test_l2_normalize_is_the_float64_rounding(axis, qdq_graph):
    """Against a float64 recomputation of the QDQ model (dequantize, ``x / max(||x||, eps)``,
    quantize ties to even): one rounding of a quotient exact to ~2**-30, so 0 LSB except on
    a float64 tie, which random inputs do not hit. A zero row gives the code of 0."""
    shape = (4, 8, 5)
    g = qdq_graph(shape, scale=0.0437, zero=120)
    prog = qb.lower(g.model(_normalize(axis)(g)))
    x = (np.random.default_rng(2).standard_normal(shape) * 2).astype(np.float32)
    x[0] = 120 * 0.0437 - 5.2444  # a row of codes at the zero point: ||x|| = 0 < eps
    codes = prog.run_integer({"x": x})[prog.inputs[0].tensor.name]
    r = np.asarray(dequantize(codes.astype(np.float64), 0.0437, 120), np.float64)
    y = r / np.maximum(np.sqrt((r * r).sum(axis=axis, keepdims=True)), 1e-12)
    expected = quantize(y, np.float64(1 / 127), np.float64(0), -128, 127)
    got = prog.run({"x": x}, integer=True)[prog.outputs[0].name]
    np.testing.assert_array_equal(got, expected)


def test_quotient_of_two_tensors_saturates_on_a_zero_denominator(qdq_graph, three_emitters,
                                                                  tmp_path):  # fmt: skip
    """``Div(a, d)`` of two quantized tensors: 1 LSB of ORT at most (one rounding of an exact
    quotient of integers; float32 rounds ``s_a / s_d``), and where ``d``'s code is its zero
    point ORT divides by 0: +-inf, saturated by QuantizeLinear to 127 / -128, which the program
    gives too; 0 / 0 (NaN in float) is the code of 0 by the kernel's policy."""
    shape = (4, 32)
    g = qdq_graph(shape, scale=0.03, zero=128)
    d = g.quant(g.node("Abs", [g.node("Sin", [g.node("Mul", [g.x, g.const(np.float32(3))])])]),
                0.01, 0)  # fmt: skip
    model = g.model(g.quant(g.node("Div", [g.x, d]), 0.5, 0, np.int8))
    prog = qb.lower(model)
    assert "divide" in prog.op_counts()
    x = np.random.default_rng(3).uniform(-3.5, 3.5, shape).astype(np.float32)
    x[0, :4] = [np.pi / 3, -np.pi / 3, 2 * np.pi / 3, 0.0]  # d's code is 0 here; a is not 0...
    x[0, 3] = 0.0  # ...except at x = 0: 0 / 0
    got = prog.run({"x": x}, integer=True)[prog.outputs[0].name].astype(np.int64)
    ref = _node_by_node(model, x)
    lsb = np.abs(got - np.rint(ref / 0.5))
    lsb[0, 3] = 0  # ORT's QuantizeLinear of NaN casts it: -128 here, undefined in C++
    assert lsb.max() <= 1, lsb.max()
    np.testing.assert_array_equal(got[0, :4], [127, -128, 127, 0])
    three_emitters(prog, {"x": x}, tmp_path)


def _slice(g, x, start: int, end: int, axis: int) -> str:
    ints = [g.const(np.array([v], np.int64)) for v in (start, end, axis)]
    return g.node("Slice", [x, *ints])


def test_roll_as_torch_exports_it_matches_ort(qdq_graph, three_emitters, tmp_path):
    """``torch.roll(x, (2, -3), (2, 3))`` as the dynamo exporter writes it: Slice -> Concat per
    axis, the second axis slicing the first Concat (a pending result, no QuantizeLinear between),
    then a QuantizeLinear on another grid. Requantization is elementwise, so the program moves
    the codes and requantizes each part once: 0 LSB from ORT (was refused: 'operands must be
    quantized tensors')."""
    shape = (1, 3, 6, 7)
    g = qdq_graph(shape, scale=0.0437, zero=120)
    a = g.node("Concat", [_slice(g, g.x, 4, 6, 2), _slice(g, g.x, 0, 4, 2)], axis=2)
    b = g.node("Concat", [_slice(g, a, 3, 7, 3), _slice(g, a, 0, 3, 3)], axis=3)
    model = g.model(g.quant(b, 0.05, 100))
    prog = qb.lower(model)
    x = (np.random.default_rng(4).standard_normal(shape) * 2).astype(np.float32)
    got = prog.run({"x": x})[prog.outputs[0].name]
    np.testing.assert_array_equal(got, _node_by_node(model, x))
    three_emitters(prog, {"x": x}, tmp_path)
