"""Issue 11 part 5: a disagreement with a known cause is explained, a broken file is bisected.

(a) Requantization ties. A 1x1 convolution with s_in = 0.1, weight code 1 at s_w = 1 and
s_out = 0.2 maps input code q to q * s_in * s_w / s_out = q / 2 in real arithmetic (0.2f is
exactly 2 * 0.1f in float32): every odd code is an exact tie. The fused kernel (ORT's
QLinearConv) and the integer program requantize with the multiplier 0.5 and round the tie to
even; the node-by-node reference computes float32(q * 0.1f) / 0.2f, which lands a hair off the
tie for some q and rounds the other way. compare must call that "rounding", not "divergence".

(b) One layer's requantization broken in a folded (QOperator) file: compare names that layer.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from debug_models import conv_1x1_qdq
from onnx import numpy_helper

import quantbridge as qb


def test_requantization_tie_is_rounding_and_only_at_ties():
    model = conv_1x1_qdq(0.1, 1.0, 0.2)
    codes = np.arange(256, dtype=np.float32).reshape(1, 1, 16, 16)
    x = codes * np.float32(0.1)  # quantizes back to the codes 0..255 exactly
    r = qb.compare(model, inputs={"x": x}, engines=["ort-ref", "ort", "integer"])
    assert r.errors == {}
    out = next(t for t in r.tensors if t["name"] == "yq")
    pairs = {p["b"]: p for p in out["pairs"]}
    for engine in ("ort", "integer"):
        p = pairs[engine]
        assert p["class"] == "rounding", p
        assert p["lsb_share"]["1"] > 0 and p["lsb_share"][">2"] == 0 and p["lsb_share"]["2"] == 0
        assert p["max_lsb"] == pytest.approx(1.0, abs=1e-6)
    assert r.first_divergence is None
    # the explanation, recomputed independently: the differing codes are exactly the ties where
    # float32(q * 0.1f) / 0.2f is off the .5
    q = codes.astype(np.int64).ravel()
    ref = np.rint((q.astype(np.float32) * np.float32(0.1)) / np.float32(0.2))  # node-by-node
    fused = np.rint(q / 2.0)  # exact tie, rounded to even
    differ = ref != fused
    assert np.all(q[differ] % 2 == 1)  # only ties
    assert pairs["ort"]["lsb_share"]["1"] == pytest.approx(differ.mean())


def _break_second_conv(folded: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """Multiply the input scale of the second QLinearConv (and only its copy) by 1.5: the
    layer's requantization multiplier s_x * s_w / s_y is off by 1.5. Returns the model and the
    broken layer's output tensor."""
    convs = [n for n in folded.graph.node if n.op_type == "QLinearConv"]
    assert len(convs) == 2
    conv = convs[1]
    scale = {i.name: i for i in folded.graph.initializer}[conv.input[1]]
    broken = numpy_helper.from_array(numpy_helper.to_array(scale) * np.float32(1.5), "broken_s")
    folded.graph.initializer.append(broken)
    conv.input[1] = "broken_s"
    return folded, conv.output[0]


def test_broken_requantization_scale_is_the_first_divergence(cnn, tmp_path):
    path, _, inputs = cnn
    broken, tensor = _break_second_conv(qb.fold(str(path)))
    broken_path = tmp_path / "broken.qop.onnx"
    onnx.save(broken, broken_path)
    r = qb.compare(path, broken_path, inputs=inputs)
    assert r.to_json()["engines"] == ["a:ort-ref", "b:ort-ref"]
    fd = r.first_divergence
    assert fd is not None and fd["name"] == tensor
    assert fd["layer"] == "conv2/conv2d_1"  # the quantizer of conv2's output, from the record
    assert (fd["a"], fd["b"]) == ("a:ort-ref", "b:ort-ref") and fd["max_lsb"] > 2
    assert r.worst(1)[0]["class"] == "divergence"  # the table shows divergences first
    assert f"first divergence: {tensor}" in str(r)
    before = [t for t in r.tensors if t["order"] < fd["order"]]
    assert before and all(p["class"] == "exact" for t in before for p in t["pairs"])
    # the same file unbroken: nothing diverges
    fine = tmp_path / "fine.qop.onnx"
    qb.fold(str(path), fine)
    assert qb.compare(path, fine, inputs=inputs).first_divergence is None


def test_a_tie_seen_in_a_finer_step_downstream_is_rounding_carried():
    # the tie model, then its output requantized to a 4x finer step (0.05): the 1-step tie
    # difference is 4 steps there, all of it carried from the input: "rounding", not divergence
    model = conv_1x1_qdq(0.1, 1.0, 0.2, shape=(1, 1, 8, 8))  # codes 0..63: no saturation at 4x
    out = model.graph.output[0].name
    fine = [numpy_helper.from_array(np.float32(0.05), "s_fine"),
            numpy_helper.from_array(np.uint8(0), "z_fine")]  # fmt: skip
    model.graph.initializer.extend(fine)
    model.graph.node.extend([
        onnx.helper.make_node("QuantizeLinear", [out, "s_fine", "z_fine"], ["fq"], name="fine"),
        onnx.helper.make_node("DequantizeLinear", ["fq", "s_fine", "z_fine"], ["fine_out"]),
    ])  # fmt: skip
    model.graph.output[0].name = "fine_out"
    onnx.checker.check_model(model, full_check=True)
    x = np.arange(64, dtype=np.float32).reshape(1, 1, 8, 8) * np.float32(0.1)
    r = qb.compare(model, inputs={"x": x}, engines=["ort-ref", "integer"])
    by_name = {t["name"]: t for t in r.tensors}
    tie, finer = by_name["yq"]["pairs"][0], by_name["fq"]["pairs"][0]
    assert tie["class"] == "rounding" and tie["max_lsb"] == pytest.approx(1.0)
    assert finer["max_lsb"] == pytest.approx(4.0) and finer["carried_lsb"] == pytest.approx(4.0)
    assert finer["class"] == "rounding"
    assert r.first_divergence is None


def test_a_tie_carried_through_a_product_and_a_constant_factor_is_rounding():
    # the tie model's output squared (DQ(yq) * DQ(yq)) on step 0.2, then times the constant 0.25
    # on step 0.05: a 1-step tie at a is 2|a| da + da^2 in the square, ~13 steps here, and a
    # quarter of it after the constant; both carried from the input ("rounding"). Before, a Mul
    # got no credit and the square was the first "divergence" (PP-OCRv4 det's hard-swish Mul).
    model = conv_1x1_qdq(0.1, 1.0, 0.2, shape=(1, 1, 8, 8))
    out = model.graph.output[0].name
    model.graph.initializer.extend([
        numpy_helper.from_array(np.float32(0.2), "s_sq"),
        numpy_helper.from_array(np.uint8(0), "z_sq"),
        numpy_helper.from_array(np.float32(0.05), "s_qt"),
        numpy_helper.from_array(np.float32(0.25), "quarter"),
    ])  # fmt: skip
    model.graph.node.extend([
        onnx.helper.make_node("Mul", [out, out], ["sq"]),
        onnx.helper.make_node("QuantizeLinear", ["sq", "s_sq", "z_sq"], ["sq_q"], name="square"),
        onnx.helper.make_node("DequantizeLinear", ["sq_q", "s_sq", "z_sq"], ["sq_dq"]),
        onnx.helper.make_node("Mul", ["sq_dq", "quarter"], ["qt"]),
        onnx.helper.make_node("QuantizeLinear", ["qt", "s_qt", "z_sq"], ["qt_q"], name="quarter"),
        onnx.helper.make_node("DequantizeLinear", ["qt_q", "s_qt", "z_sq"], ["qt_out"]),
    ])  # fmt: skip
    model.graph.output[0].name = "qt_out"
    onnx.checker.check_model(model, full_check=True)
    codes = np.arange(64, dtype=np.float32).reshape(1, 1, 8, 8)
    r = qb.compare(model, inputs={"x": codes * np.float32(0.1)}, engines=["ort-ref", "integer"])
    assert r.errors == {} and r.unmatched == {}
    by_name = {t["name"]: t["pairs"][0] for t in r.tensors}
    # the bound recomputed independently: node by node rounds float32(q * 0.1f) / 0.2f, the
    # integer program q / 2 to even (test (a)); a = the reference's value, da the tie
    q = codes.ravel().astype(np.int64)
    a = np.rint((q.astype(np.float32) * np.float32(0.1)) / np.float32(0.2)) * 0.2
    da = np.abs(a - np.rint(q / 2.0) * 0.2)
    assert da.max() == pytest.approx(0.2, abs=1e-6)  # the premise: ties differ
    bound = float((2 * np.abs(a) * da + da * da).max())
    sq, qt = by_name["sq_q"], by_name["qt_q"]
    assert sq["carried_lsb"] == pytest.approx(bound / 0.2, rel=1e-5)  # float32 values: 1e-5
    assert sq["max_lsb"] > 2 and sq["class"] == "rounding", sq
    assert qt["carried_lsb"] == pytest.approx(sq["max_abs"] * 0.25 / 0.05, rel=1e-5)
    assert qt["max_lsb"] > 2 and qt["class"] == "rounding", qt
    assert r.first_divergence is None
