"""compare's credit through a LayerNormalization or a Softmax of one site
(``debug/_gain_norm``). The bounds are checked against float64 recomputations of the op on
random rows and perturbations (hypothesis): the actual change never exceeds the credit. Then on
files: a 1-step tie carried into a layer norm of small spread (gain ``|gamma| / sigma`` of many
steps) is "rounding", not a first divergence (before: no credit), and a changed ``gamma`` in the
second file is still found."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from debug_models import TIE_S, TIE_S_IN, tie_prefix
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb
from quantbridge.debug._gain_norm import (
    attention_bound,
    masked_attention_bound,
    norm_bound,
    quotient_bound,
)


def _layer_norm(x, gamma, beta, eps):
    mu = x.mean(-1, keepdims=True)
    return gamma * (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) + beta


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


_ROWS = st.tuples(st.integers(1, 3), st.integers(2, 24), st.integers(0, 2**32 - 1))


@settings(max_examples=100, deadline=None)
@given(_ROWS, st.floats(1e-4, 3.0), st.floats(1e-3, 1.0), st.sampled_from([1e-12, 1e-5, 1e-2]))
def test_layer_norm_change_is_within_the_credit(shape, spread, step, eps):
    rows, n, seed = shape
    rng = np.random.default_rng(seed)
    x = rng.normal(0, spread, (rows, n)) * rng.integers(0, 2, (rows, n))  # some equal values
    bound_d = step * rng.integers(0, 3, (rows, n))  # differences of 0-2 steps
    d = bound_d * rng.choice([-1.0, 1.0], (rows, n))
    gamma = rng.normal(0, 2, n)
    change = np.abs(_layer_norm(x + d, gamma, 0.3, eps) - _layer_norm(x, gamma, 0.3, eps))
    norm = {"op": "LayerNormalization", "axis": -1, "epsilon": eps, "gamma": np.abs(gamma)}
    bound = norm_bound(x, bound_d, norm)
    covered = bound > 0  # rows whose difference exceeds their spread get no credit (0)
    # 1e-9: float64 rounding of the two recomputations (values of order |gamma| <= ~8)
    assert np.all(change[covered] <= bound[covered] * (1 + 1e-9) + 1e-9)
    spare = np.sqrt(x.var(-1) + eps) > np.sqrt((bound_d**2).mean(-1))
    assert np.all(covered[spare] | (change[spare] == 0))  # credit wherever sigma > rms(D)


@settings(max_examples=100, deadline=None)
@given(_ROWS, st.floats(0.1, 20.0), st.floats(1e-3, 0.5))
def test_softmax_change_is_within_the_credit(shape, spread, step):
    rows, n, seed = shape
    rng = np.random.default_rng(seed)
    x = rng.normal(0, spread, (rows, n))
    bound_d = step * rng.integers(0, 3, (rows, n))
    d = bound_d * rng.choice([-1.0, 1.0], (rows, n))
    change = np.abs(_softmax(x + d) - _softmax(x))
    bound = norm_bound(x, bound_d, {"op": "Softmax", "axis": -1})
    assert np.all(change <= bound * (1 + 1e-9) + 1e-15)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.floats(0.1, 4.0), st.integers(0, 2**32 - 1))
def test_attention_change_is_within_the_credit(t, d, spread, seed):
    # Softmax(c q @ k) @ v with float scores (PP-OCRv4 rec's attention after import_onnx)
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(0, spread, s) for s in ((2, t, d), (2, d, t), (2, t, d)))
    steps = [0.02 * rng.integers(0, 3, x.shape) for x in (q, k, v)]
    moved = [
        x + s * rng.choice([-1.0, 1.0], x.shape) for x, s in zip((q, k, v), steps, strict=True)
    ]
    c = 1 / np.sqrt(d)

    def attention(q, k, v):
        return _softmax(c * q @ k) @ v

    change = np.abs(attention(*moved) - attention(q, k, v))
    bound = attention_bound([q, k, v], steps, {"op": "attention", "scale": c})
    assert np.all(change <= bound * (1 + 1e-9) + 1e-12)


@settings(max_examples=100, deadline=None)
@given(_ROWS, st.floats(1e-3, 3.0), st.floats(1e-3, 0.5))
def test_quotient_change_is_within_the_credit(shape, spread, step):
    # (x - mean x) / sqrt(v), v the quantized variance + eps (ORT's quantize_static of a
    # written-out layer norm): v read as its own tensor, perturbed independently of x
    rows, n, seed = shape
    rng = np.random.default_rng(seed)
    x = rng.normal(0, spread, (rows, n))
    v = x.var(-1, keepdims=True) + 1e-5
    dx = step * rng.integers(0, 3, x.shape)
    dv = v * rng.uniform(0, 1.2, v.shape)  # up to beyond v itself: no credit there
    moved_v = np.maximum(v + dv * rng.choice([-1.0, 1.0], v.shape), 1e-12)
    moved_x = x + dx * rng.choice([-1.0, 1.0], x.shape)

    def quotient(x, v):
        return (x - x.mean(-1, keepdims=True)) / np.sqrt(v)

    change = np.abs(quotient(moved_x, moved_v) - quotient(x, v))
    bound = quotient_bound([x, v], [dx, dv], {"axes": (-1,)})
    covered = np.broadcast_to(dv < v, bound.shape)
    assert np.all(change[covered] <= bound[covered] * (1 + 1e-9) + 1e-9)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.floats(0.1, 4.0), st.integers(0, 2**32 - 1))
def test_masked_attention_change_is_within_the_credit(t, d, spread, seed):
    # Softmax(where(mask, c s, -inf)) @ v, safe softmax (a fully masked row -> 0): BERT's and
    # GPT-2's attention in our export; the bound does not know the mask
    rng = np.random.default_rng(seed)
    s, v = rng.normal(0, spread, (2, t, t)), rng.normal(0, spread, (2, t, d))
    mask = rng.random((2, t, t)) < 0.7
    ds, dv = (0.02 * rng.integers(0, 3, x.shape) for x in (s, v))
    c = 0.5

    def attention(s, v):
        with np.errstate(invalid="ignore"):
            scores = np.where(mask, c * s, -np.inf)
            top = np.max(scores, -1, keepdims=True)
            e = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
            p = e / e.sum(-1, keepdims=True)
        return np.where(np.isnan(p), 0.0, p) @ v

    moved = (s + ds * rng.choice([-1.0, 1.0], s.shape), v + dv * rng.choice([-1.0, 1.0], v.shape))
    change = np.abs(attention(*moved) - attention(s, v))
    bound = masked_attention_bound([s, v], [ds, dv], {"op": "masked_attention", "scale": c})
    assert np.all(change <= bound * (1 + 1e-9) + 1e-12)


def test_the_layer_norm_bound_is_its_gain_for_one_element():
    # one element of a row of spread sigma moved by one step s: about |gamma| s / sigma
    x = np.linspace(-1, 1, 64)[None]
    sigma = np.sqrt(x.var() + 1e-5)
    d = np.zeros_like(x)
    d[0, 10] = 0.01
    norm = {"op": "LayerNormalization", "axis": -1, "epsilon": 1e-5, "gamma": np.full(64, 2.0)}
    assert norm_bound(x, d, norm).max() == pytest.approx(2.0 * 0.01 / sigma, rel=0.2)


S_IN, S_TIE, S_OUT = TIE_S_IN, TIE_S, 0.02


def _tie_then(op: str, tie_s_w: float = 1.0, gamma_scale: float = 1.0) -> onnx.ModelProto:
    """x[1, 2, 4, 8] -> Q -> DQ -> depthwise 1x1 Conv (a tie at odd codes when ``tie_s_w`` is
    1; 1 + 1e-6 rounds them up) -> Q -> DQ -> ``op`` over the last axis -> Q(``S_OUT``) -> DQ."""

    def init(name, value):
        return numpy_helper.from_array(np.asarray(value), name)

    gamma = (np.linspace(0.5, 1.5, 8) * gamma_scale).astype(np.float32)
    inits, prefix = tie_prefix(tie_s_w)
    inits += [
        init("gamma", gamma), init("beta", np.full(8, 0.1, np.float32)),
        init("s_out", np.float32(S_OUT)), init("z_out", np.int8(0)),
    ]  # fmt: skip
    if op == "LayerNormalization":
        under_test = [
            helper.make_node("LayerNormalization", ["td", "gamma", "beta"], ["y"], axis=-1)
        ]
    elif op == "Softmax":
        under_test = [helper.make_node("Softmax", ["td"], ["y"], axis=-1)]
    elif op == "padded":  # a (here empty) pad of the layer norm (timm Swin's window pad)
        inits.append(init("pads", np.zeros(8, np.int64)))
        under_test = [
            helper.make_node("LayerNormalization", ["td", "gamma", "beta"], ["ln"], axis=-1),
            helper.make_node("Pad", ["ln", "pads"], ["y"]),
        ]
    elif op == "pooled":  # a max pool of the layer norm, then quantized (timm NesT's ConvPool)
        under_test = [
            helper.make_node("LayerNormalization", ["td", "gamma", "beta"], ["ln"], axis=-1),
            helper.make_node("MaxPool", ["ln"], ["y"], kernel_shape=[1, 2], pads=[0, 0, 0, 1]),
        ]
    elif op == "masked":  # Where(mask, x, c), the mask a graph input (an attention mask)
        inits.append(init("fill", np.float32(-1.0)))
        under_test = [helper.make_node("Where", ["mask", "td", "fill"], ["y"])]
    else:  # the layer norm of opsets < 17, written out (PP-OCRv4 rec through import_onnx)
        inits += [init("axes", np.array([-1], np.int64)), init("two", np.float32(2.0)),
                  init("eps", np.float32(1e-5))]  # fmt: skip
        under_test = [
            helper.make_node("ReduceMean", ["td", "axes"], ["mean"]),
            helper.make_node("Sub", ["td", "mean"], ["centered"]),
            helper.make_node("Pow", ["centered", "two"], ["square"]),
            helper.make_node("ReduceMean", ["square", "axes"], ["var"]),
            helper.make_node("Add", ["var", "eps"], ["var_eps"]),
            helper.make_node("Sqrt", ["var_eps"], ["sigma"]),
            helper.make_node("Div", ["centered", "sigma"], ["y"]),
        ]
    nodes = [
        *prefix,
        *under_test,
        helper.make_node("QuantizeLinear", ["y", "s_out", "z_out"], ["yq"], name="quant_y"),
        helper.make_node("DequantizeLinear", ["yq", "s_out", "z_out"], ["out"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 8])]
    if op == "masked":
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, 2, 4, 8]))
    graph = helper.make_graph(
        nodes, "tie_then_norm", inputs,
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 2, 4, 8])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


# even codes 0..14 on every row, one of them odd (9: a tie); after the tie conv (a halving) the
# rows have a spread of about 0.46 and one 1-step (0.2) difference each
_CODES = np.tile(np.array([0, 2, 4, 6, 8, 9, 12, 14], np.float32), (1, 2, 4, 1))


@pytest.mark.parametrize(
    "op", ["LayerNormalization", "Softmax", "decomposed", "masked", "pooled", "padded"]
)
def test_a_tie_carried_into_a_normalization_is_rounding(op):
    a, b = _tie_then(op), _tie_then(op, tie_s_w=1.000001)
    inputs = {"x": _CODES * np.float32(S_IN)}
    if op == "masked":
        inputs["mask"] = np.arange(64).reshape(1, 2, 4, 8) % 3 != 0
    r = qb.compare(a, b, inputs=inputs)
    assert r.errors == {} and r.unmatched == {}
    by_name = {t["name"]: t["pairs"][0] for t in r.tensors}
    assert by_name["tq"]["max_lsb"] == pytest.approx(1.0)  # the premise: 1-step ties upstream
    y = by_name["yq"]
    assert y["carried_lsb"] >= y["max_lsb"] - 1, y
    if op != "Softmax":
        assert y["max_lsb"] > 1.5, y  # the premise: beyond one step, so the credit decides
    assert y["class"] == "rounding", y
    assert r.first_divergence is None


def test_a_changed_gamma_is_still_the_first_divergence():
    a = _tie_then("LayerNormalization")
    b = _tie_then("LayerNormalization", tie_s_w=1.000001, gamma_scale=3.0)
    r = qb.compare(a, b, inputs={"x": _CODES * np.float32(S_IN)})
    y = next(t["pairs"][0] for t in r.tensors if t["name"] == "yq")
    assert y["carried_lsb"] > 1, y  # the credit is there, and the change is beyond it
    assert r.first_divergence is not None and r.first_divergence["name"] == "yq"


def test_masked_attention_bound_of_a_huge_score_difference_is_capped_without_a_warning():
    # timm Visformer (random init, scores of +-1e3): expm1(2 D) overflowed to inf, a numpy
    # RuntimeWarning printed by compare, before the cap at 2 took it back. The bound is
    # 2 max|v| + max|dv| (|P' - P|_1 <= 2), computed without the overflow
    v = np.array([[[1.0, -3.0], [2.0, 0.5]]])  # [1, T=2, d=2]
    dv = np.array([[[0.1, 0.0], [0.0, 0.2]]])
    ds = np.array([[[0.0, 800.0], [1.0, 0.0]]])  # [1, T, T]: exp(1600) overflows float64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bound = masked_attention_bound([None, v], [ds, dv], {"scale": 1.0})
    assert np.allclose(bound, np.broadcast_to([4.1, 6.2], (1, 2, 2)), rtol=0, atol=1e-12)
