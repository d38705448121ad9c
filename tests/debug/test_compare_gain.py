"""compare's credit for an error carried through an elementwise chain (``debug/_gain``): a
1-step input difference through a GELU and requantized is "rounding", not a first divergence
(wav2vec2 in OpenVINO against ONNX Runtime named a false divergence right after a GELU), and
each op's slope bound equals the one computed here independently, in closed form."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from debug_models import conv_1x1_qdq
from onnx import helper, numpy_helper

import quantbridge as qb
from quantbridge.debug._match import find_sites

SQRT2 = math.sqrt(2.0)


def _gelu_nodes(x: str, out: str) -> tuple[list, list]:
    """The exporter's decomposed GELU: x * (0.5 * (1 + erf(x / sqrt 2)))."""
    inits = [numpy_helper.from_array(np.float32(v), n)
             for n, v in (("g_sqrt2", SQRT2), ("g_one", 1.0), ("g_half", 0.5))]  # fmt: skip
    nodes = [
        helper.make_node("Div", [x, "g_sqrt2"], ["g_d"]),
        helper.make_node("Erf", ["g_d"], ["g_e"]),
        helper.make_node("Add", ["g_e", "g_one"], ["g_a"]),
        helper.make_node("Mul", ["g_half", "g_a"], ["g_h"]),
        helper.make_node("Mul", [x, "g_h"], [out], name="node_gelu"),
    ]
    return nodes, inits


def test_a_tie_carried_through_a_gelu_and_a_transpose_is_rounding():
    # the tie model (1-step differences between ort-ref and integer at odd input codes, see
    # test_known_disagreement), then GELU and a Transpose, requantized on a 4x finer step: up to
    # 1.13 * 4 steps apart there, all of it carried. Before, no credit through the GELU: a
    # "divergence" at the requantization.
    model = conv_1x1_qdq(0.1, 1.0, 0.2, shape=(1, 1, 8, 8))
    out = model.graph.output[0].name
    gelu, inits = _gelu_nodes(out, "gelu")
    model.graph.initializer.extend(
        inits + [numpy_helper.from_array(np.float32(0.05), "s_fine"),
                 numpy_helper.from_array(np.uint8(0), "z_fine")]
    )  # fmt: skip
    model.graph.node.extend(gelu + [
        helper.make_node("Transpose", ["gelu"], ["tr"], perm=[0, 1, 3, 2], name="node_transpose"),
        helper.make_node("QuantizeLinear", ["tr", "s_fine", "z_fine"], ["fq"], name="fine"),
        helper.make_node("DequantizeLinear", ["fq", "s_fine", "z_fine"], ["fine_out"]),
    ])  # fmt: skip
    model.graph.output[0].name = "fine_out"
    # quantbridge's export record names the quantizer after the fx node it reads, here a no-op
    # ``.to(dtype)`` after the transpose (wav2vec2's pos_conv_embed: "encoder/to")
    record = {"encoder/to_2": {"scale": "s_fine", "kind": "activation"}}
    helper.set_model_props(model, {"quantbridge.quantizers": json.dumps(record)})
    onnx.checker.check_model(model, full_check=True)
    x = np.arange(64, dtype=np.float32).reshape(1, 1, 8, 8) * np.float32(0.1)
    r = qb.compare(model, inputs={"x": x}, engines=["ort-ref", "integer"])
    assert r.errors == {} and r.unmatched == {}
    by_name = {t["name"]: t for t in r.tensors}
    tie, fine = by_name["yq"]["pairs"][0], by_name["fq"]["pairs"][0]
    assert tie["max_lsb"] == pytest.approx(1.0)  # the premise: a 1-step tie upstream
    # the GELU's slope between neighbouring codes of yq (step 0.2, codes 0..255 from 0),
    # in closed form: x Phi(x) with Phi(x) = (1 + erf(x / sqrt 2)) / 2
    v = np.arange(256) * 0.2
    gelu_v = v * (1 + np.array([math.erf(t / SQRT2) for t in v])) / 2
    slope = np.abs(np.diff(gelu_v)).max() / 0.2
    assert fine["carried_lsb"] == pytest.approx(slope * 0.2 / 0.05, rel=1e-4)  # float32 eval
    assert fine["max_lsb"] > 2, fine  # the premise: beyond one step here
    assert fine["class"] == "rounding", fine
    assert r.first_divergence is None
    # the label names the op computing the tensor, not the no-op call (was "encoder/to_2")
    assert by_name["fq"]["layer"] == "encoder/transpose"


def _phi(x):
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def _sig(x):
    return 1 / (1 + math.exp(-x))


# op -> (ONNX nodes from "u" to "y", its function in closed form, its slope bound on the whole
# line: derived in the comment)
CASES = {
    # d/dx x Phi(x) = Phi(x) + x phi(x); its derivative phi(x) (2 - x^2) is 0 at x = sqrt 2
    "gelu": (
        None,
        lambda x: x * (1 + math.erf(x / SQRT2)) / 2,
        0.5 * (1 + math.erf(1.0)) + SQRT2 * _phi(SQRT2),
    ),
    # d/dx x s(x) = s (1 + x (1 - s)); its derivative s (1 - s) (2 + x (1 - 2 s)) is 0 at
    # x = 2.3994 (numerically), where the slope is 1.0998
    "silu": (
        [helper.make_node("Sigmoid", ["u"], ["s"]), helper.make_node("Mul", ["u", "s"], ["y"])],
        lambda x: x * _sig(x),
        1.0998,
    ),
    # s' = s (1 - s) <= 1/4 at 0
    "sigmoid": ([helper.make_node("Sigmoid", ["u"], ["y"])], _sig, 0.25),
    "tanh": ([helper.make_node("Tanh", ["u"], ["y"])], math.tanh, 1.0),  # 1 - tanh^2 <= 1
    # x (x + 3) / 6 on [-3, 3]: slope (2x + 3) / 6, 3/2 at x = 3
    "hardswish": (
        [helper.make_node("HardSwish", ["u"], ["y"])],
        lambda x: x * min(max(x + 3, 0), 6) / 6,
        1.5,
    ),
    # torch's hardsigmoid: alpha 1/6, beta 1/2: slope 1/6 inside [-3, 3]
    "hardsigmoid": (
        [helper.make_node("HardSigmoid", ["u"], ["y"], alpha=1 / 6, beta=0.5)],
        lambda x: min(max(x / 6 + 0.5, 0), 1),
        1 / 6,
    ),
    "leakyrelu": (
        [helper.make_node("LeakyRelu", ["u"], ["y"], alpha=0.1)],
        lambda x: x if x > 0 else 0.1 * x,
        1.0,
    ),
    "erf": ([helper.make_node("Erf", ["u"], ["y"])], math.erf, 2 / math.sqrt(math.pi)),
    # exp has no bound on the line: on the codes' range, its value at the top
    "exp": ([helper.make_node("Exp", ["u"], ["y"])], math.exp, None),
}


def _chain_model(nodes, extra=()) -> onnx.ModelProto:
    """x -> Q(0.03, zero point 128) -> DQ = u -> nodes -> y -> Q(0.01) -> DQ."""
    inits = [numpy_helper.from_array(np.float32(0.03), "s_u"),
             numpy_helper.from_array(np.uint8(128), "z_u"),
             numpy_helper.from_array(np.float32(0.01), "s_y"),
             numpy_helper.from_array(np.int8(0), "z_y"), *extra]  # fmt: skip
    body = [
        helper.make_node("QuantizeLinear", ["x", "s_u", "z_u"], ["uq"]),
        helper.make_node("DequantizeLinear", ["uq", "s_u", "z_u"], ["u"]),
        *nodes,
        helper.make_node("QuantizeLinear", ["y", "s_y", "z_y"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "s_y", "z_y"], ["out"]),
    ]
    graph = helper.make_graph(
        body, "chain", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [4])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("op", sorted(CASES))
def test_each_elementwise_ops_slope_bound(op):
    nodes, f, line_bound = CASES[op]
    inits = []
    if nodes is None:
        nodes, inits = _gelu_nodes("u", "y")
    model = _chain_model(nodes, inits)
    site = {s.name: s for s in find_sites(model)}["yq"]
    assert site.inputs == ("uq",)
    # independent: the closed form on every code of u (x = (k - 128) * 0.03, k = 0..255)
    v = (np.arange(256) - 128) * 0.03
    fv = np.array([f(t) for t in v])
    expected = np.abs(np.diff(fv)).max() / 0.03
    # the chain is evaluated in float32: differences of values up to e^3.8 = 45 carry ~4e-6
    assert site.gain == pytest.approx(expected, rel=1e-4, abs=1e-4)
    if line_bound is not None:  # the codes span [-3.84, 3.81] with 0.03 steps: the maximum
        # is there, within the slope's change over one step (f'' * 0.03)
        assert site.gain == pytest.approx(line_bound, abs=0.01)
        assert site.gain <= line_bound + 1e-4
    else:
        assert site.gain == pytest.approx(math.exp(v[-1]), rel=0.02)  # exp's slope at the top


def test_a_chain_with_a_per_channel_constant_gets_no_slope():
    scale = numpy_helper.from_array(np.full(4, 2.0, np.float32), "c4")
    model = _chain_model([helper.make_node("Mul", ["u", "c4"], ["t"]),
                          helper.make_node("Erf", ["t"], ["y"])], [scale])  # fmt: skip
    site = {s.name: s for s in find_sites(model)}["yq"]
    assert site.gain is None


@pytest.mark.parametrize("clamp", [None, "Relu", "Clip"])
def test_a_tie_carried_through_a_matmul_of_two_activations_is_rounding(clamp):
    # the tie model's output times itself by MatMul (attention's Q K^T reads two quantized
    # activations; wav2vec2 OV vs ORT named such a MatMul the first divergence, 2 steps on 0.05%
    # of values, its inputs 1 step apart): the bound |da| @ |a| + |a| @ |da| + |da| @ |da|.
    # With a Relu / Clip(0, 24) between the product and its QuantizeLinear (timm ReXNet's SE:
    # x * sigmoid(s) -> ReLU6, a false first divergence, 3 steps "carried 0"): neither op moves
    # two values further apart, so the product's bound holds unchanged
    model = conv_1x1_qdq(0.1, 1.0, 0.2, shape=(1, 1, 8, 8))
    out = model.graph.output[0].name
    model.graph.initializer.extend([
        numpy_helper.from_array(np.float32(0.1), "s_mm"),
        numpy_helper.from_array(np.uint8(0), "z_mm"),
        numpy_helper.from_array(np.float32(0.0), "lo"),
        numpy_helper.from_array(np.float32(24.0), "hi"),
    ])  # fmt: skip
    product = [helper.make_node("MatMul", [out, out], ["mm"])]
    if clamp is not None:
        ins = ["mm", "lo", "hi"] if clamp == "Clip" else ["mm"]
        product.append(helper.make_node(clamp, ins, ["mm_c"]))
    model.graph.node.extend([
        *product,
        helper.make_node("QuantizeLinear", [product[-1].output[0], "s_mm", "z_mm"], ["mm_q"],
                         name="mm"),
        helper.make_node("DequantizeLinear", ["mm_q", "s_mm", "z_mm"], ["mm_out"]),
    ])  # fmt: skip
    model.graph.output[0].name = "mm_out"
    onnx.checker.check_model(model, full_check=True)
    # codes 0..15: products summed over 8 stay below 8 * 1.6^2 = 20.5 < 24 (205 steps of 0.1;
    # the Clip cuts nothing)
    codes = (np.arange(64) % 16).astype(np.float32).reshape(1, 1, 8, 8)
    r = qb.compare(model, inputs={"x": codes * np.float32(0.1)}, engines=["ort-ref", "integer"])
    assert r.errors == {} and r.unmatched == {}
    mm = {t["name"]: t["pairs"][0] for t in r.tensors}["mm_q"]
    # the bound recomputed independently (test_known_disagreement's product test: node by node
    # rounds float32(q * 0.1f) / 0.2f, the integer program q / 2 to even)
    q = codes.reshape(8, 8).astype(np.int64)
    a = np.rint((q.astype(np.float32) * np.float32(0.1)) / np.float32(0.2)) * 0.2
    da = np.abs(a - np.rint(q / 2.0) * 0.2)
    bound = float((da @ np.abs(a) + np.abs(a) @ da + da @ da).max())
    assert mm["carried_lsb"] == pytest.approx(bound / 0.1, rel=1e-5)
    assert mm["max_lsb"] > 1, mm  # the premise: beyond one step
    assert mm["class"] == "rounding", mm
    assert r.first_divergence is None


@pytest.mark.parametrize(
    "quantizer, node, label",
    [
        ("encoder/to_2", "node_transpose_2", "encoder/transpose_2"),
        ("encoder/to_2", "encoder.transpose_1", "encoder.transpose_1"),  # module-path node names
        ("ff.intermediate_dropout/dropout_3", "node_gelu_3", "ff.intermediate_dropout/gelu_3"),
        ("contiguous", "node_permute", "permute"),
        ("encoder/linear_4", "node_linear_4", "encoder/linear_4"),  # a real op: its own name
        (None, "node_add", "node_add"),  # no record: the ONNX node
    ],
)
def test_a_quantizer_named_after_a_no_op_call_is_labelled_by_the_op(quantizer, node, label):
    from quantbridge.debug._match import _label

    assert _label(quantizer, node) == label


def _tie_linear_model(quantized: bool = True) -> tuple[onnx.ModelProto, np.ndarray]:
    """The tie model's output through x @ W + b, quantized (``lin_q``, int8, step 0.1), or left
    float as the graph output (``logits``, the Add named ``head``: a classifier's float head)."""
    model = conv_1x1_qdq(0.1, 1.0, 0.2, shape=(1, 1, 8, 8))
    out = model.graph.output[0].name
    w_codes = (np.arange(32).reshape(4, 8) % 7 - 3).astype(np.int8)  # [N, K], torch's layout
    model.graph.initializer.extend([
        numpy_helper.from_array(w_codes, "w_lin"),
        numpy_helper.from_array(np.float32(0.5), "s_wl"),
        numpy_helper.from_array(np.int8(0), "z_wl"),
        numpy_helper.from_array(np.float32([0.1, -0.2, 0.3, 0.0]), "b_lin"),
    ])  # fmt: skip
    model.graph.node.extend([
        helper.make_node("DequantizeLinear", ["w_lin", "s_wl", "z_wl"], ["w_dq"]),
        helper.make_node("Transpose", ["w_dq"], ["w_t"], perm=[1, 0]),
        helper.make_node("MatMul", [out, "w_t"], ["mm"]),
    ])  # fmt: skip
    if quantized:
        model.graph.initializer.extend([
            numpy_helper.from_array(np.float32(0.1), "s_lin"),
            numpy_helper.from_array(np.int8(0), "z_lin"),
        ])  # fmt: skip
        model.graph.node.extend([
            helper.make_node("Add", ["mm", "b_lin"], ["lin"]),
            helper.make_node("QuantizeLinear", ["lin", "s_lin", "z_lin"], ["lin_q"], name="lin"),
            helper.make_node("DequantizeLinear", ["lin_q", "s_lin", "z_lin"], ["lin_out"]),
        ])  # fmt: skip
        model.graph.output[0].name = "lin_out"
    else:
        model.graph.node.append(helper.make_node("Add", ["mm", "b_lin"], ["logits"], name="head"))
        model.graph.output[0].name = "logits"
    model.graph.output[0].type.tensor_type.shape.dim[3].dim_value = 4
    onnx.checker.check_model(model, full_check=True)
    return model, w_codes


def test_a_tie_carried_through_a_linear_layer_is_rounding():
    # the tie model's output through x @ W + b, W int8 weights (as the exporter writes a Linear:
    # MatMul by a transposed DequantizeLinear, then the bias Add): its inputs' 1-step ties can
    # carry |dx| @ |W|, here several steps of the output (wav2vec2 OV vs ORT: out_proj, 2 steps
    # on 0.02% of values, was the first divergence once GELU and attention were credited)
    model, w_codes = _tie_linear_model()
    codes = (np.arange(64) % 16).astype(np.float32).reshape(1, 1, 8, 8)
    r = qb.compare(model, inputs={"x": codes * np.float32(0.1)}, engines=["ort-ref", "integer"])
    assert r.errors == {} and r.unmatched == {}
    lin = {t["name"]: t["pairs"][0] for t in r.tensors}["lin_q"]
    q = codes.reshape(8, 8).astype(np.int64)  # as in the MatMul test above
    a = np.rint((q.astype(np.float32) * np.float32(0.1)) / np.float32(0.2)) * 0.2
    da = np.abs(a - np.rint(q / 2.0) * 0.2)
    bound = float((da @ np.abs(w_codes.T * 0.5)).max())
    assert lin["carried_lsb"] == pytest.approx(bound / 0.1, rel=1e-5)
    assert lin["max_lsb"] > 1, lin  # the premise: beyond one step
    assert lin["class"] == "rounding", lin
    assert r.first_divergence is None


def _gate_model(combine: str, step: float, w_scale: float) -> onnx.ModelProto:
    """The tie model (weight scale ``w_scale``), then ``x <combine> sigmoid(y)`` -> Q(step)."""
    model = conv_1x1_qdq(0.1, w_scale, 0.2, shape=(1, 1, 8, 8))
    out = model.graph.output[0].name
    model.graph.initializer.extend([
        numpy_helper.from_array(np.float32(step), "s_g"),
        numpy_helper.from_array(np.uint8(0), "z_g"),
    ])  # fmt: skip
    model.graph.node.extend([
        helper.make_node("Sigmoid", [out], ["sig"]),
        helper.make_node(combine, ["xd", "sig"], ["gate"]),
        helper.make_node("QuantizeLinear", ["gate", "s_g", "z_g"], ["gq"], name="gate"),
        helper.make_node("DequantizeLinear", ["gq", "s_g", "z_g"], ["gate_out"]),
    ])  # fmt: skip
    model.graph.output[0].name = "gate_out"
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("combine", ["Mul", "Add"])
def test_a_tie_carried_into_a_gate_reading_two_sites_is_rounding(combine):
    # x * sigmoid(y) (a gate: two quantized tensors, one through an elementwise chain, no
    # requantization in between), y the tie model's output and x its input. Two files on
    # ort-ref: b's tie weight scale is 1 + 1e-6, so b rounds y's ties up where a rounds them to
    # even (1-step differences of y; none of x). Before: no credit (a chain of two sites), a
    # "divergence". The bound: |x| * L * |dy| for the product, L * |dy| for the sum, L the
    # sigmoid's slope between neighbouring codes of y (step 0.2 from 0: its steepest,
    # (sigmoid(0.2) - 1/2) / 0.2)
    step = 0.01 if combine == "Mul" else 0.02
    a, b = _gate_model(combine, step, 1.0), _gate_model(combine, step, 1.000001)
    codes = (np.arange(64) % 16).astype(np.float32).reshape(1, 1, 8, 8)
    r = qb.compare(a, b, inputs={"x": codes * np.float32(0.1)})
    assert r.errors == {} and r.unmatched == {}
    by_name = {t["name"]: t["pairs"][0] for t in r.tensors}
    assert by_name["yq"]["max_lsb"] == pytest.approx(1.0)  # the premise: 1-step ties of y
    gate = by_name["gq"]
    x = codes.reshape(8, 8) * np.float32(0.1)  # float32 node by node, as ort-ref
    y_a, y_b = (np.rint((x * np.float32(w)) / np.float32(0.2)) * 0.2 for w in (1.0, 1.000001))
    dy = np.abs(y_a - y_b)
    slope = (_sig(0.2) - 0.5) / 0.2
    bound = (np.abs(x) * slope * dy).max() if combine == "Mul" else (slope * dy).max()
    assert gate["carried_lsb"] == pytest.approx(float(bound) / step, rel=1e-5)
    assert gate["max_lsb"] > 1, gate  # the premise: beyond one step
    assert gate["class"] == "rounding", gate
    assert r.first_divergence is None


def test_a_tie_carried_into_a_float_output_linear_is_rounding():
    # the Linear test above with the Linear's output left float, the graph output (a timm
    # classifier's head: Gemm of the pooled features, no QuantizeLinear after it). ORT against
    # ort-ref named that float output the first divergence of every such model (ReXNet,
    # MobileNetV4: "a float tensor") although its input was 1 step apart: a float output of a
    # Linear / conv of one site gets the same |dx| @ |W| credit
    model, w_codes = _tie_linear_model(quantized=False)
    codes = (np.arange(64) % 16).astype(np.float32).reshape(1, 1, 8, 8)
    r = qb.compare(model, inputs={"x": codes * np.float32(0.1)}, engines=["ort-ref", "integer"])
    assert r.errors == {} and r.unmatched == {}
    head = {t["name"]: t["pairs"][0] for t in r.tensors}["logits"]
    q = codes.reshape(8, 8).astype(np.int64)  # as in the MatMul test
    a = np.rint((q.astype(np.float32) * np.float32(0.1)) / np.float32(0.2)) * 0.2
    da = np.abs(a - np.rint(q / 2.0) * 0.2)
    logits = a @ (w_codes.T * 0.5) + np.float32([0.1, -0.2, 0.3, 0.0])
    bound = float((da @ np.abs(w_codes.T * 0.5)).max())
    assert head["max_abs"] > 1e-2 * np.abs(logits).max()  # the premise: beyond float tolerance
    assert head["max_abs"] <= bound * (1 + 1e-6)
    assert head["class"] == "rounding", head
    assert r.first_divergence is None


def test_a_pad_of_codes_passes_its_input_on():
    # the Linear test's output, then Pad on its int8 codes (the zero point as the pad value),
    # DequantizeLinear, Reshape and QuantizeLinear at the same step: the exporter's form of a
    # pad of a quantized tensor (timm Swin's PatchMerging: Q -> Pad -> DQ -> Reshape -> Q). The
    # Pad's output is no site, and compare stopped there: the Reshape had "carried 0.00", a
    # false first divergence 2 steps from ORT against ort-ref. A Pad and a Reshape copy values
    # (unit gain): the carried error is the Linear's
    model, _ = _tie_linear_model()
    model.graph.initializer.extend([
        numpy_helper.from_array(np.int64([0, 0, 0, 0, 0, 0, 1, 0]), "pads"),
        numpy_helper.from_array(np.int64([1, 1, 36]), "shape"),
    ])  # fmt: skip
    model.graph.node.extend([
        helper.make_node("Pad", ["lin_q", "pads", "z_lin"], ["pad_q"], name="pad"),
        helper.make_node("DequantizeLinear", ["pad_q", "s_lin", "z_lin"], ["pad_dq"]),
        helper.make_node("Reshape", ["pad_dq", "shape"], ["flat"], name="flat"),
        helper.make_node("QuantizeLinear", ["flat", "s_lin", "z_lin"], ["flat_q"], name="flat_q"),
        helper.make_node("DequantizeLinear", ["flat_q", "s_lin", "z_lin"], ["flat_out"]),
    ])  # fmt: skip
    del model.graph.output[:]
    model.graph.output.append(
        helper.make_tensor_value_info("flat_out", onnx.TensorProto.FLOAT, [1, 1, 36])
    )
    onnx.checker.check_model(model, full_check=True)
    site = {s.name: s for s in find_sites(model)}["flat_q"]
    assert site.inputs == ("lin_q",) and site.unit_gain, site
    codes = (np.arange(64) % 16).astype(np.float32).reshape(1, 1, 8, 8)
    r = qb.compare(model, inputs={"x": codes * np.float32(0.1)}, engines=["ort-ref", "integer"])
    assert r.errors == {} and r.unmatched == {}
    pairs = {t["name"]: t["pairs"][0] for t in r.tensors}
    lin, flat = pairs["lin_q"], pairs["flat_q"]
    assert flat["max_lsb"] == lin["max_lsb"] > 1, (lin, flat)  # the premise: beyond one step
    assert flat["carried_lsb"] == pytest.approx(lin["max_lsb"]), flat  # same step: a copy
    assert flat["class"] == "rounding", flat
    assert r.first_divergence is None
