"""compare's credit for two ops timm models showed as false first divergences (ort-ref against
ORT's fused kernels, 1-step ties carried into them): ConvNeXt-V2's GRN ratio ``g / (mean g +
eps)``, ``g`` an L2 norm of a site (``_gain_norm.l2_ratio_bound``, checked against float64
recomputations with hypothesis), and a float graph output that is a site divided by a constant
(timm's distilled ViT: ``(head + head_dist) / 2``, the sum a site; ``_gain.product_at``), and
ConvNeXt's head, a layer norm of the pooled features ``LN(permute(x.mean((2, 3))))``
(``_gain_norm._pooled``), and a float output averaging two float heads (``_gain_output``). On
files: a 1-step tie upstream is "rounding"; a changed constant in the second file is still the
first divergence."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from debug_models import TIE_S, TIE_S_IN, tie_prefix
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb
from quantbridge.debug._gain_norm import l2_ratio_bound, norm_bound
from quantbridge.debug._gain_output import terms_bound

_GRN = {"op": "l2_ratio", "l2_axes": (1, 2), "mean_axes": (-1,)}


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(1e-3, 1.0), st.sampled_from([0.0, 1e-6, 1e-2]))
def test_l2_ratio_bound_holds(seed, size, eps):
    # x (N, H, W, C) as in GRN; the other engine's x' = x + d with |d| <= D element by element,
    # d of either sign (also the extremes +-D); the float64 change never exceeds the bound
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 3, 4, 5)) * rng.uniform(0.1, 3.0)
    big = rng.uniform(size=x.shape) * size
    norm = {**_GRN, "epsilon": eps}

    def ratio(v):
        g = np.sqrt((v * v).sum(axis=(1, 2), keepdims=True))
        return g / (g.mean(axis=-1, keepdims=True) + eps)

    bound = l2_ratio_bound(x, big, norm)
    signs = np.sign(rng.normal(size=x.shape))
    for d in (big * rng.uniform(-1, 1, x.shape), big, -big, big * signs):
        actual = np.abs(ratio(x + d) - ratio(x))
        credited = bound > 0  # elsewhere no credit: nothing to check
        # 1e-12: float64 rounding of the recomputation (values of order 1)
        assert np.all(actual[credited] <= bound[credited] * (1 + 1e-9) + 1e-12)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(1e-3, 0.3))
def test_pooled_layer_norm_bound_holds(seed, size):
    # ConvNeXt's head: x (N, C, H, W) -> mean over (2, 3) -> (N, H, W, C) -> LN over C
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 6, 3, 4)) * rng.uniform(0.1, 3.0)
    big = rng.uniform(size=x.shape) * size
    gamma = rng.normal(size=6)
    pre = (("ReduceMean", (2, 3)), ("Transpose", [0, 2, 3, 1]))
    norm = {
        "op": "LayerNormalization",
        "axis": -1,
        "epsilon": 1e-6,
        "gamma": np.abs(gamma),
        "pre": pre,
    }

    def head(v):
        p = v.mean(axis=(2, 3), keepdims=True).transpose(0, 2, 3, 1)
        mu, var = p.mean(-1, keepdims=True), p.var(-1, keepdims=True)
        return gamma * (p - mu) / np.sqrt(var + 1e-6)

    bound = norm_bound(x, big, norm)
    for d in (big * rng.uniform(-1, 1, x.shape), big, big * np.sign(rng.normal(size=x.shape))):
        actual = np.abs(head(x + d) - head(x))
        credited = bound > 0
        # 1e-9 relative: float64 rounding of the recomputation (values of order 1 / sigma)
        assert np.all(actual[credited] <= bound[credited] * (1 + 1e-9) + 1e-12)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(-3.0, 3.0), st.booleans())
def test_two_heads_bound_holds(seed, c, sigmoid):
    # c * (f(x1 @ W1) + x2 @ W2), f a Sigmoid (slope <= 1/4) or none, x_i moved by dx_i
    rng = np.random.default_rng(seed)
    x1, x2, dx1, dx2 = (rng.normal(size=(3, 5)) for _ in range(4))
    w1, w2 = rng.normal(size=(5, 4)), rng.normal(size=(5, 4))
    f = (lambda y: 1 / (1 + np.exp(-y))) if sigmoid else (lambda y: y)

    def out(a, b):
        return c * (f(a @ w1) + b @ w2)

    slope = 0.25 if sigmoid else 1.0
    bound = terms_bound([dx1, dx2], ((abs(c) * slope * w1, None), (abs(c) * w2, None)))
    actual = np.abs(out(x1 + dx1, x2 + dx2) - out(x1, x2))
    assert np.all(actual <= bound * (1 + 1e-9) + 1e-12)  # float64 rounding of the recomputation


def _init(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


S_IN, S_TIE = TIE_S_IN, TIE_S  # the tie conv halves the input codes: every odd code a tie


def _tie_then(under_test: list, inits: list, out_type, tie_s_w: float = 1.0) -> onnx.ModelProto:
    """x -> Q -> DQ -> Conv (halving: ties) -> Q -> DQ ``td`` -> ``under_test`` -> ``out``."""
    prefix_inits, prefix = tie_prefix(tie_s_w)
    inits = [*prefix_inits, *inits]
    nodes = [*prefix, *under_test]
    graph = helper.make_graph(
        nodes, "tie_then", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, out_type)], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def _grn(tie_s_w: float = 1.0, eps: float = 1e-6) -> onnx.ModelProto:
    """GRN as torch.onnx (dynamo) writes ConvNeXt-V2's: ReduceL2 over (1, 2), ReduceMean over
    -1, both keepdims, + eps, Div, then the ratio quantized (s_out 0.01: about 100 steps)."""
    inits = [
        _init("l2_axes", np.array([1, 2], np.int64)), _init("mean_axes", np.array([-1], np.int64)),
        _init("eps", np.float32(eps)), _init("s_out", np.float32(0.01)), _init("z_out", np.uint8(0)),
    ]  # fmt: skip
    nodes = [
        helper.make_node("ReduceL2", ["td", "l2_axes"], ["g"], keepdims=1),
        helper.make_node("ReduceMean", ["g", "mean_axes"], ["mean"], keepdims=1),
        helper.make_node("Add", ["mean", "eps"], ["denominator"]),
        helper.make_node("Div", ["g", "denominator"], ["n"], name="grn_div"),
        helper.make_node("QuantizeLinear", ["n", "s_out", "z_out"], ["nq"], name="quant_n"),
        helper.make_node("DequantizeLinear", ["nq", "s_out", "z_out"], ["out"]),
    ]
    return _tie_then(nodes, inits, [1, 1, 1, 8], tie_s_w)


def _halved(tie_s_w: float = 1.0, divisor: float = 2.0) -> onnx.ModelProto:
    """A float graph output ``td / divisor`` (deit_distilled's ``(head + head_dist) / 2``)."""
    nodes = [helper.make_node("Div", ["td", "divisor"], ["out"], name="halve")]
    return _tie_then(nodes, [_init("divisor", np.float32(divisor))], [1, 2, 4, 8], tie_s_w)


def _pooled_ln(tie_s_w: float = 1.0, beta: float = 0.1) -> onnx.ModelProto:
    """A head as torch.onnx writes ConvNeXt's: ReduceMean (here over H) -> Transpose -> LN over
    the last axis (8 elements) -> Reshape, then quantized (s_out 0.05: |out| < 5, no clipping)."""
    gamma = np.linspace(0.5, 1.5, 8, dtype=np.float32)
    inits = [
        _init("pool_axes", np.array([2], np.int64)), _init("shape", np.array([1, 16], np.int64)),
        _init("gamma", gamma), _init("beta", np.full(8, beta, np.float32)),
        _init("s_out", np.float32(0.05)), _init("z_out", np.int8(0)),
    ]  # fmt: skip
    nodes = [
        helper.make_node("ReduceMean", ["td", "pool_axes"], ["pooled"], keepdims=1),
        helper.make_node("Transpose", ["pooled"], ["moved"], perm=[0, 2, 1, 3]),
        helper.make_node("LayerNormalization", ["moved", "gamma", "beta"], ["ln"], axis=-1),
        helper.make_node("Reshape", ["ln", "shape"], ["flat"]),
        helper.make_node("QuantizeLinear", ["flat", "s_out", "z_out"], ["nq"], name="quant_n"),
        helper.make_node("DequantizeLinear", ["nq", "s_out", "z_out"], ["out"]),
    ]
    return _tie_then(nodes, inits, [1, 16], tie_s_w)


def _two_heads(tie_s_w: float = 1.0, w2_scale: float = 1.0) -> onnx.ModelProto:
    """Two float heads (MatMul by a constant, + bias) of the tie tensor, summed in float and
    halved: the float output ``(head + head_dist) / 2``."""
    w1 = (np.arange(24).reshape(8, 3) % 5 - 2).astype(np.float32) * np.float32(0.5)
    w2 = (np.arange(24).reshape(8, 3) % 3 - 1).astype(np.float32) * np.float32(w2_scale)
    inits = [_init("w1", w1), _init("w2", w2), _init("b1", np.float32([0.1, 0.0, -0.1])),
             _init("two", np.float32(2.0))]  # fmt: skip
    nodes = [
        helper.make_node("MatMul", ["td", "w1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["head"]),
        helper.make_node("MatMul", ["td", "w2"], ["head_dist"]),
        helper.make_node("Add", ["head", "head_dist"], ["sum"]),
        helper.make_node("Div", ["sum", "two"], ["out"], name="average"),
    ]
    return _tie_then(nodes, inits, [1, 2, 4, 3], tie_s_w)


# codes 0..15 along the last axis, varied per row; odd codes are ties after the halving conv
_CODES = (np.arange(64, dtype=np.float32).reshape(1, 2, 4, 8) * 3) % 16
_INPUTS = {"x": _CODES * np.float32(S_IN)}


@pytest.mark.parametrize("model", [_grn, _halved, _pooled_ln, _two_heads])
def test_a_tie_carried_into_grn_a_halved_output_or_a_pooled_norm_is_rounding(model):
    # the second file moves every tie the other way (weight scale 1.000001): 1 step on the
    # tie tensor; before, the GRN ratio and the halved float output got no credit ("carried
    # 0.00", named the first divergence)
    r = qb.compare(model(), model(tie_s_w=1.000001), inputs=_INPUTS)
    assert r.errors == {} and r.unmatched == {}
    by_name = {t["name"]: t["pairs"][0] for t in r.tensors}
    assert by_name["tq"]["max_lsb"] == pytest.approx(1.0)  # the premise: 1-step ties upstream
    last = by_name["out" if model in (_halved, _two_heads) else "nq"]
    assert last["max_abs"] > 0, last  # the premise: the difference reaches it
    if model in (_grn, _pooled_ln):
        assert last["max_lsb"] > 1.5, last  # beyond one step: the credit decides
    assert last["class"] == "rounding", last
    assert r.first_divergence is None


@pytest.mark.parametrize(
    ("model", "changed", "name"),
    [
        (_grn, {"eps": 0.5}, "nq"),
        (_halved, {"divisor": 1.9}, "out"),
        (_pooled_ln, {"beta": 3.1}, "nq"),  # 60 steps, beyond the credit (35 steps)
        (_two_heads, {"w2_scale": 1.2}, "out"),
    ],
)
def test_a_changed_constant_is_still_the_first_divergence(model, changed, name):
    r = qb.compare(model(), model(tie_s_w=1.000001, **changed), inputs=_INPUTS)
    assert r.first_divergence is not None and r.first_divergence["name"] == name, r.first_divergence
