"""compare's credit for an error carried through a convolution (``debug/_gain.conv_weight``): a
1-step tie upstream of a Conv, a strided depthwise Conv or a ConvTranspose moves its output by
``conv(dx, W)`` exactly (a linear op), element by element, several steps of the output's grid; that is "rounding", not a first
divergence (before: no credit, so every conv after a tie was a divergence), while a real change
at the conv (a weight code moved) is still the first divergence. The bound is recomputed here
independently, with numpy loops."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from debug_models import TIE_S, TIE_S_IN, tie_prefix
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb

S_IN, S_TIE = TIE_S_IN, TIE_S  # the tie conv: code round(q * 0.1 * 1.0 / 0.2), a tie at odd q


def _tie_then(op: str, w_codes: np.ndarray, s_w: float, s_out: float, attrs: dict, out_shape,
              tie_s_w: float = 1.0) -> onnx.ModelProto:  # fmt: skip
    """x[1, 2, 8, 8] -> Q -> DQ -> depthwise 1x1 Conv (code 1, a tie at odd input codes) -> Q ->
    DQ -> ``op`` with int8 weights ``w_codes`` at ``s_w`` and a bias -> Q(``s_out``) -> DQ."""
    c_out = w_codes.shape[1] * attrs.get("group", 1) if op == "ConvTranspose" else w_codes.shape[0]

    def init(name, value):
        return numpy_helper.from_array(np.asarray(value), name)

    inits, prefix = tie_prefix(tie_s_w)
    inits += [
        init("w", w_codes), init("s_w", np.float32(s_w)),
        init("b", (np.arange(c_out) * 0.1 - 0.05).astype(np.float32)),
        init("s_out", np.float32(s_out)), init("z_out", np.int8(0)),
    ]  # fmt: skip
    nodes = [
        *prefix,
        helper.make_node("DequantizeLinear", ["w", "s_w", "z_w"], ["wd"]),
        helper.make_node(op, ["td", "wd", "b"], ["y"], name="under_test", **attrs),
        helper.make_node("QuantizeLinear", ["y", "s_out", "z_out"], ["yq"], name="quant_y"),
        helper.make_node("DequantizeLinear", ["yq", "s_out", "z_out"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes, "tie_then_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, c_out, *out_shape])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def _conv_ref(x, w, stride, pads, group):
    """Direct convolution (cross-correlation, as ONNX Conv), numpy loops; pads [t, l, b, r]."""
    x = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    c_out, c_in_g, kh, kw = w.shape
    ho, wo = (x.shape[2] - kh) // stride + 1, (x.shape[3] - kw) // stride + 1
    y = np.zeros((1, c_out, ho, wo))
    for o in range(c_out):
        g = o // (c_out // group)
        for i in range(ho):
            for j in range(wo):
                patch = x[0, g * c_in_g:(g + 1) * c_in_g, i * stride:i * stride + kh,
                          j * stride:j * stride + kw]  # fmt: skip
                y[0, o, i, j] = np.sum(patch * w[o])
    return y


def _conv_transpose_ref(x, w, stride):
    """ONNX ConvTranspose without pads, one group: every input scatters w * x[i, j]."""
    c_in, c_out, kh, kw = w.shape
    h, wd = x.shape[2], x.shape[3]
    y = np.zeros((1, c_out, (h - 1) * stride + kh, (wd - 1) * stride + kw))
    for c in range(c_in):
        for i in range(h):
            for j in range(wd):
                y[0, :, i * stride : i * stride + kh, j * stride : j * stride + kw] += (
                    x[0, c, i, j] * w[c]
                )
    return y


def _tie_difference(codes: np.ndarray) -> np.ndarray:
    """integer - ort-ref (signed) on the tie tensor (test_known_disagreement: node by node rounds
    float32(q * 0.1f) / 0.2f to even, the integer program q / 2 to even)."""
    q = codes.astype(np.int64)
    a = np.rint((q.astype(np.float32) * np.float32(S_IN)) / np.float32(S_TIE)) * S_TIE
    return np.rint(q / 2.0) * S_TIE - a


W3 = (np.arange(3 * 2 * 9).reshape(3, 2, 3, 3) % 7 - 3).astype(np.int8)
WDW = (np.arange(2 * 9).reshape(2, 1, 3, 3) % 5 - 2).astype(np.int8)
WT = (np.arange(2 * 1 * 4).reshape(2, 1, 2, 2) % 5 - 2).astype(np.int8)
CASES = {
    # op, weights, attributes, output H x W, the bound from |dx| (numpy, independent)
    "conv3x3": ("Conv", W3, {"pads": [1, 1, 1, 1]}, (8, 8),
                lambda d, w: _conv_ref(d, w, 1, [1, 1, 1, 1], 1)),
    "depthwise_stride2_asymmetric": (
        "Conv", WDW, {"group": 2, "strides": [2, 2], "pads": [0, 0, 1, 1]}, (4, 4),
        lambda d, w: _conv_ref(d, w, 2, [0, 0, 1, 1], 2)),
    "conv_transpose": ("ConvTranspose", WT, {"strides": [2, 2]}, (16, 16),
                       lambda d, w: _conv_transpose_ref(d, w, 2)),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_tie_carried_through_a_convolution_is_rounding(case):
    op, w_codes, attrs, out_shape, reference = CASES[case]
    s_w, s_out = 0.5, 0.1
    model = _tie_then(op, w_codes, s_w, s_out, attrs, out_shape)
    codes = (np.arange(128) % 16).astype(np.float32).reshape(1, 2, 8, 8)  # odd codes: ties
    r = qb.compare(model, inputs={"x": codes * np.float32(S_IN)}, engines=["ort-ref", "integer"])
    assert r.errors == {} and r.unmatched == {}
    by_name = {t["name"]: t["pairs"][0] for t in r.tensors}
    assert by_name["tq"]["max_lsb"] == pytest.approx(1.0)  # the premise: a 1-step tie upstream
    y = by_name["yq"]
    dx, w = _tie_difference(codes), w_codes.astype(np.float64) * s_w
    # the credit is |conv(dx, W)| element by element, reported as the per-tensor credit that
    # decides the same (compare._credit): at most its largest element, within 1 step of
    # max_lsb where the class is rounding, and never above the old conv(|dx|, |W|)
    bound = np.abs(reference(dx, w)).max() / s_out
    assert y["carried_lsb"] <= bound * (1 + 1e-6), (y, bound)
    assert y["carried_lsb"] <= reference(np.abs(dx), np.abs(w)).max() / s_out * (1 + 1e-6)
    assert y["max_lsb"] > 1.5, y  # the premise: beyond one step, so the credit decides
    assert y["class"] == "rounding", y
    assert r.first_divergence is None


def test_a_changed_weight_at_a_conv_is_still_the_first_divergence():
    # two files on ort-ref: b's tie conv weight scale is 1 + 1e-6 (its ties round up: 1-step
    # differences carried into the conv) and one of b's conv weight codes moved from 3 to -3.
    # The credit is there (carried > 0) and the conv's difference is far beyond it.
    s_w, s_out = 0.5, 0.1
    a = _tie_then("Conv", W3, s_w, s_out, {"pads": [1, 1, 1, 1]}, (8, 8))
    w_b = W3.copy()
    w_b[0, 0, 1, 1] = -3 if w_b[0, 0, 1, 1] != -3 else 3
    b = _tie_then("Conv", w_b, s_w, s_out, {"pads": [1, 1, 1, 1]}, (8, 8), tie_s_w=1.000001)
    codes = (np.arange(128) % 16).astype(np.float32).reshape(1, 2, 8, 8)
    r = qb.compare(a, b, inputs={"x": codes * np.float32(S_IN)})
    by_name = {t["name"]: t["pairs"][0] for t in r.tensors}
    assert by_name["tq"]["class"] == "rounding" and by_name["tq"]["max_lsb"] == pytest.approx(1)
    y = by_name["yq"]
    assert y["carried_lsb"] > 1, y  # the credit applies ...
    assert y["class"] == "divergence", y  # ... and is not enough
    assert r.first_divergence is not None and r.first_divergence["name"] == "yq"
    # the text says what the inputs carried, in which units, and how far the output ends up
    text = str(r)
    assert "carried LSB" in text.splitlines()[0] and "LSB: steps of each tensor's own scale" in text
    carried = f"{y['carried_lsb']:.2f}"
    assert f"from a:ort-ref, its inputs carried {carried} LSB" in text
    assert (
        f"model output out (tensor yq): b:ort-ref vs a:ort-ref SQNR {y['sqnr_db']:.1f} dB" in text
    )
