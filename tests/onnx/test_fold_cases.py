"""``FoldQOperator``, one hand-built QDQ graph per rewrite case (numbered as in
``quantbridge.onnx.passes``), plus the graphs where a case must *not* apply.

Every folded graph is checked three ways:

* structure: the expected integer op is there and no QuantizeLinear / DequantizeLinear is left
  except the graph input's Q and the graph output's DQ;
* against ONNX Runtime running the QDQ graph with its default optimizations, i.e. the same fused
  integer kernels (QLinearConv, QGemm, QLinearAdd, ...): bit-identical (0 LSB) wherever ONNX
  Runtime fuses the op itself. ``FLOAT_IN_ORT`` names the cases ONNX Runtime runs in float
  between the Q/DQ (spatial ReduceMean, MatMul+Add on 3-D inputs); there the folded integer op
  may land on the other side of a rounding tie: at most 1 LSB;
* against ``onnx.reference`` evaluating the QDQ graph in float (an independent implementation of
  the QDQ semantics): at most 1 LSB, since an integer kernel requantizes ``acc * (sx*sw/sy)``
  while the float graph rounds ``(sum of products in float32) / sy``; both round the same real
  number, so they differ only when float32 rounding moves it across a .5 tie (one code).
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import quantbridge as qb
from quantbridge.onnx.passes import FoldQOperator, foldable_ops

RNG = np.random.default_rng(0)


class QDQGraph:
    """A small QDQ graph: float input ``x`` -> Q -> DQ, ops, weights behind DQ, output DQ."""

    def __init__(self, shape, scale=0.05, zero_point=128, dtype=np.uint8, opset=19):
        self.nodes, self.inits, self.opset, self.k = [], [], opset, 0
        self.weight_scales: dict[str, np.ndarray] = {}
        self.inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))]
        self.x = self.qdq("x", scale, zero_point, dtype)

    def name(self, base):
        self.k += 1
        return f"{base}{self.k}"

    def const(self, value, base="c"):
        t = numpy_helper.from_array(np.asarray(value), self.name(base))
        self.inits.append(t)
        return t.name

    def op(self, op_type, inputs, n_out=1, **attrs):
        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(op_type), **attrs))
        return outs[0]

    def q(self, tensor, scale, zero_point=0, dtype=np.uint8):
        return self.op(
            "QuantizeLinear", [tensor, self.const(np.float32(scale)), self.const(dtype(zero_point))]
        )

    def dq(self, tensor, scale, zero_point, dtype=np.uint8, axis=None):
        scale = np.asarray(scale, np.float32)
        zp = np.zeros(scale.shape, dtype) + dtype(zero_point)
        attrs = {} if axis is None else {"axis": axis}
        return self.op("DequantizeLinear", [tensor, self.const(scale), self.const(zp)], **attrs)

    def qdq(self, tensor, scale, zero_point=128, dtype=np.uint8):
        return self.dq(self.q(tensor, scale, zero_point, dtype), scale, zero_point, dtype)

    def weight(self, shape, axis=0, per_channel=True):
        # 7-bit codes: ONNX Runtime's u8 x s8 kernels on AVX2 without VNNI (vpmaddubsw) add
        # pairs of products in saturating int16; |w| <= 63 keeps 2 * 255 * 63 < 2**15, so the
        # fused kernels compute the exact sum the float reference does
        w = RNG.integers(-63, 64, shape).astype(np.int8)
        n = shape[axis] if per_channel else 1
        scale = (RNG.random(n) * 0.01 + 0.002).astype(np.float32)
        scale = scale if per_channel else scale[0]
        out = self.dq(self.const(w, "w"), scale, 0, np.int8, axis if per_channel else None)
        self.weight_scales[out] = scale
        return out

    def bias(self, n, input_scale, weight_dq):
        """int32 codes behind a DQ at ``input_scale * weight_scale`` (ONNX's bias convention)."""
        scale = qb.numerics.bias_scale(input_scale, self.weight_scales[weight_dq])
        codes = RNG.integers(-2000, 2000, n).astype(np.int32)
        return self.dq(self.const(codes, "b"), scale, 0, np.int32, axis=0)

    def model(self, out, scale=0.1, zero_point=128, dtype=np.uint8):
        self.qdq(out, scale, zero_point, dtype)
        self.nodes[-1].output[0] = "y"  # the output DQ writes the graph output
        graph = helper.make_graph(
            self.nodes,
            "case",
            self.inputs,
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 10
        inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
        shape = inferred[self.nodes[-1].input[0]].type.tensor_type.shape  # the output Q's
        model.graph.output[0].type.tensor_type.shape.CopyFrom(shape)
        return model


def _ops(model):
    return collections.Counter(n.op_type for n in model.graph.node)


def _run_ort(model, x):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _output_scale(model):
    last = next(n for n in model.graph.node if n.output[0] == "y")
    return float(
        numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == last.input[1]))
    )


def _fold_and_check(model, shape, expect: dict, float_in_ort=False):
    """Fold ``model``; assert ``expect`` op counts, one Q and one DQ left, the agreement bounds
    of the module docstring; return the folded model."""
    result = FoldQOperator()(model)
    folded = result.model
    assert result.modified
    onnx.checker.check_model(folded, full_check=True)
    ops = _ops(folded)
    for op, count in expect.items():
        assert ops[op] == count, f"{op}: {ops[op]} != {count} in {dict(ops)}"
    assert ops["QuantizeLinear"] == 1 and ops["DequantizeLinear"] == 1, dict(ops)
    x = RNG.standard_normal(shape).astype(np.float32) * 2
    lsb = _output_scale(model)
    y_fold, y_qdq = _run_ort(folded, x), _run_ort(model, x)
    diff = np.abs(y_fold - y_qdq) / lsb
    assert diff.max() <= (1.0 if float_in_ort else 0.0) + 1e-3, diff.max()
    y_ref = ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert np.abs(y_fold - y_ref).max() / lsb <= 1.0 + 1e-3
    assert y_fold.size >= 8 and np.unique(y_fold).size > 2  # not a constant (saturated) output
    return folded


# -- cases 1-3: data movement on integers, Q/DQ pairs cancelled ----------------------------------
def test_case1_dequantize_sinks_below_data_movement():
    g = QDQGraph((2, 4, 8, 8))
    t = g.op("MaxPool", [g.x], kernel_shape=[2, 2], strides=[2, 2])
    t = g.op("Transpose", [t], perm=[0, 2, 3, 1])
    t = g.op(
        "Slice",
        [
            t,
            g.const(np.array([1], np.int64)),
            g.const(np.array([4], np.int64)),
            g.const(np.array([1], np.int64)),
        ],
    )
    t = g.op("Unsqueeze", [t, g.const(np.array([0], np.int64))])
    t = g.op("Squeeze", [t, g.const(np.array([0], np.int64))])
    t = g.op("Resize", [t, "", g.const(np.array([1, 1, 2, 2], np.float32))], mode="nearest")
    t = g.op("Flatten", [t], axis=1)
    t = g.op("Reshape", [t, g.const(np.array([2, -1], np.int64))])
    model = g.model(t, scale=0.05, zero_point=128)  # the input's parameters: pure data movement
    folded = _fold_and_check(model, (2, 4, 8, 8), {"MaxPool": 1, "Resize": 1, "Slice": 1})
    assert _ops(folded)["DequantizeLinear"] == 1


def test_case2_quantize_rises_above_data_movement():
    g = QDQGraph((2, 3, 6, 6))
    t = g.op("Conv", [g.x, g.weight((4, 3, 3, 3))], kernel_shape=[3, 3])
    t = g.op("Flatten", [t], axis=1)  # the Q behind it moves up, then the Conv folds
    folded = _fold_and_check(g.model(t, 0.2), (2, 3, 6, 6), {"QLinearConv": 1, "Flatten": 1})
    flatten = next(n for n in folded.graph.node if n.op_type == "Flatten")
    assert (
        flatten.output[0]
        == next(n for n in folded.graph.node if n.op_type == "DequantizeLinear").input[0]
    )


def test_case3_equal_pair_cancels_and_requantize_stays():
    g = QDQGraph((2, 8))
    t = g.qdq(g.x, 0.05, 128)  # same parameters as the input's pair: cancels
    model = g.model(t, 0.05, 128)
    assert _ops(FoldQOperator()(model).model) == {"QuantizeLinear": 1, "DequantizeLinear": 1}
    g = QDQGraph((2, 8))
    t = g.qdq(g.x, 0.07, 120)  # other parameters: a requantization, not a no-op
    folded = FoldQOperator()(g.model(t, 0.07, 120)).model
    assert _ops(folded)["QuantizeLinear"] == 2


# -- cases 4-7: weighted ops ----------------------------------------------------------------------
@pytest.mark.parametrize("groups", [1, 2, 8], ids=["dense", "grouped", "depthwise"])
def test_case4_conv(groups):
    g = QDQGraph((2, 8, 7, 7))
    w = g.weight((8, 8 // groups, 3, 3))
    b = g.bias(8, 0.05, w)
    t = g.op(
        "Conv", [g.x, w, b], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=groups, strides=[2, 2]
    )
    folded = _fold_and_check(g.model(t, 0.1), (2, 8, 7, 7), {"QLinearConv": 1})
    qconv = next(n for n in folded.graph.node if n.op_type == "QLinearConv")
    assert (
        helper.get_attribute_value(next(a for a in qconv.attribute if a.name == "group")) == groups
    )
    assert len(qconv.input) == 9  # the int32 bias is passed through


def test_case4_conv_float_bias_is_quantized():
    g = QDQGraph((2, 3, 5, 5))
    b = g.const((RNG.standard_normal(4) * 0.3).astype(np.float32))
    t = g.op("Conv", [g.x, g.weight((4, 3, 3, 3)), b], kernel_shape=[3, 3])
    folded = _fold_and_check(g.model(t, 0.1), (2, 3, 5, 5), {"QLinearConv": 1})
    qconv = next(n for n in folded.graph.node if n.op_type == "QLinearConv")
    bias = next(i for i in folded.graph.initializer if i.name == qconv.input[8])
    assert bias.data_type == TensorProto.INT32  # numerics.quantize_bias at input x weight scale


def test_case4_int32_bias_at_another_scale_is_requantized():
    g = QDQGraph((2, 3, 5, 5))
    w = g.weight((4, 3, 3, 3))
    codes = RNG.integers(-2000, 2000, 4).astype(np.int32)
    wrong = 2 * qb.numerics.bias_scale(0.05, g.weight_scales[w])  # twice input x weight scale
    t = g.op(
        "Conv", [g.x, w, g.dq(g.const(codes), wrong, 0, np.int32, axis=0)], kernel_shape=[3, 3]
    )
    folded = _fold_and_check(g.model(t, 0.1), (2, 3, 5, 5), {"QLinearConv": 1})
    qconv = next(n for n in folded.graph.node if n.op_type == "QLinearConv")
    bias = numpy_helper.to_array(
        next(i for i in folded.graph.initializer if i.name == qconv.input[8])
    )
    np.testing.assert_array_equal(bias, 2 * codes)  # same real bias at the scale QLinearConv uses


@pytest.mark.parametrize("b", ["per_channel", "per_tensor", "activation"])
def test_case5_gemm(b):
    g = QDQGraph((4, 16))
    if b == "activation":  # B is itself a quantized activation: x @ x^T
        t = g.op("Gemm", [g.x, g.op("Transpose", [g.x], perm=[1, 0])])
        expect = {"QGemm": 1, "Transpose": 1}
    else:
        w = g.weight((10, 16), axis=0, per_channel=b == "per_channel")
        t = g.op("Gemm", [g.x, w, g.bias(10, 0.05, w)], transB=1)
        expect = {"QGemm": 1}
    _fold_and_check(g.model(t, 0.1), (4, 16), expect)


@pytest.mark.parametrize("operand", ["activation", "weight"])
def test_case6_matmul(operand):
    g = QDQGraph((2, 4, 6, 8))
    if operand == "activation":  # q @ k^T: two quantized activations
        t = g.op("MatMul", [g.x, g.op("Transpose", [g.x], perm=[0, 1, 3, 2])])
        scale = 0.5
    else:  # a stored weight, one scale per column
        t, scale = g.op("MatMul", [g.x, g.weight((8, 5), axis=1)]), 0.05
    expect = {"QLinearMatMul": 1, "Transpose": int(operand == "activation")}
    _fold_and_check(g.model(t, scale), (2, 4, 6, 8), expect)


@pytest.mark.parametrize("shape", [(4, 16), (2, 5, 16)], ids=["2d", "3d"])
def test_case7_matmul_add_is_linear(shape):
    g = QDQGraph(shape)
    w = g.weight((12, 16), axis=0)  # nn.Linear's [out, in] weight, per output channel
    wt = g.op("Transpose", [w], perm=[1, 0])  # as exported: DQ -> Transpose -> MatMul
    t = g.op("MatMul", [g.x, wt])
    t = g.op("Add", [t, g.bias(12, 0.05, w)])
    model = g.model(t, 0.1)
    g.inputs[0] = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    folded = _fold_and_check(
        model,
        shape,
        {"QGemm": 1, "Transpose": 0, "MatMul": 0, "Add": 0},
        float_in_ort=len(shape) == 3,
    )
    assert _ops(folded)["Reshape"] == (2 if len(shape) == 3 else 0)


# -- cases 8-12: elementwise, concat, pools, activations ------------------------------------------
@pytest.mark.parametrize("op", ["Add", "Mul", "Sum"])
def test_case8_add_mul_broadcast(op):
    g = QDQGraph((2, 4, 3, 3))
    codes = g.const(RNG.integers(0, 256, (1, 4, 1, 1)).astype(np.uint8))
    other = g.dq(codes, 0.04, 10)  # a stored operand on another grid, broadcast over N, H, W
    t = g.op(op, [g.x, other])
    qop = "QLinearMul" if op == "Mul" else "QLinearAdd"  # a two-input Sum is an Add
    _fold_and_check(g.model(t, 0.3 if op == "Mul" else 0.15), (2, 4, 3, 3), {qop: 1})


def test_case9_concat_rescales_or_copies():
    g = QDQGraph((2, 3, 4))
    a = g.qdq(g.op("Sigmoid", [g.x]), 1 / 255, 0)
    t = g.op("Concat", [g.x, a], axis=1)
    _fold_and_check(g.model(t, 0.06, 120), (2, 3, 4), {"QLinearConcat": 1, "QLinearSigmoid": 1})
    g = QDQGraph((2, 3, 4))
    t = g.op("Concat", [g.x, g.op("Transpose", [g.x], perm=[0, 1, 2])], axis=2)
    _fold_and_check(g.model(t, 0.05, 128), (2, 3, 4), {"Concat": 1})  # same grid: a copy


def test_case10_average_pool():
    g = QDQGraph((2, 4, 8, 8))
    t = g.op("AveragePool", [g.x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    _fold_and_check(g.model(t, 0.03), (2, 4, 8, 8), {"QLinearAveragePool": 1})


@pytest.mark.parametrize("form", ["global", "mean_keepdims", "mean_flat"])
def test_case11_global_average_pool(form):
    g = QDQGraph((2, 6, 5, 5))
    if form == "global":
        t = g.op("GlobalAveragePool", [g.x])
    else:
        axes = g.const(np.array([-2, -1], np.int64))
        t = g.op("ReduceMean", [g.x, axes], keepdims=int(form == "mean_keepdims"))
    folded = _fold_and_check(
        g.model(t, 0.02),
        (2, 6, 5, 5),
        {"QLinearGlobalAveragePool": 1},
        float_in_ort=form != "global",
    )
    assert _ops(folded)["Flatten"] == int(form == "mean_flat")


@pytest.mark.parametrize("op", ["Sigmoid", "LeakyRelu"])
def test_case12_activations(op):
    g = QDQGraph((2, 16))
    t = g.op(op, [g.x], **({"alpha": 0.1} if op == "LeakyRelu" else {}))
    scale, zp = (1 / 255, 0) if op == "Sigmoid" else (0.05, 100)
    _fold_and_check(g.model(t, scale, zp), (2, 16), {f"QLinear{op}": 1})


# -- cases 13-14: Relu / Clip ---------------------------------------------------------------------
@pytest.mark.parametrize("op", ["Conv", "MatMul"])
@pytest.mark.parametrize("act", ["Relu", "ReLU6"])
def test_case13_activation_absorbed(act, op):
    g = QDQGraph((2, 3, 6, 6))
    if op == "Conv":
        t = g.op("Conv", [g.x, g.weight((4, 3, 3, 3))], kernel_shape=[3, 3])
    else:
        t = g.op("MatMul", [g.x, g.weight((6, 4), axis=1)])
    if act == "Relu":
        t, scale = g.op("Relu", [t]), 0.05
    else:  # the output grid [0, 255 * 6/255] ends at 6: Q(6) = 255 = qmax
        t, scale = g.op("Clip", [t, g.const(np.float32(0)), g.const(np.float32(6))]), 6 / 255
    qop = "QLinearConv" if op == "Conv" else "QLinearMatMul"
    folded = _fold_and_check(g.model(t, scale, 0), (2, 3, 6, 6), {qop: 1})
    assert not {"Relu", "Clip"} & set(_ops(folded))


def test_case14_clip_on_integers():
    g = QDQGraph((2, 16))
    t = g.op("Clip", [g.x, g.const(np.float32(-1.0)), g.const(np.float32(2.0))])
    folded = _fold_and_check(g.model(t, 0.05, 128), (2, 16), {"Clip": 1})
    clip = next(n for n in folded.graph.node if n.op_type == "Clip")
    bounds = [
        int(numpy_helper.to_array(i))
        for name in clip.input[1:]
        for i in folded.graph.initializer
        if i.name == name
    ]
    assert bounds == [128 - 20, 128 + 40]  # Q(-1.0), Q(2.0) at scale 0.05, zero point 128


# -- not applied ----------------------------------------------------------------------------------
def test_case3b_relu_the_grid_cannot_absorb_becomes_clip_on_codes():
    """Before case 3b this conv stayed float (``Q(relu(x)) != Q(x)`` when the zero point is
    above qmin); now it is QLinearConv followed by a Clip of the codes at [Q(0), qmax]."""
    g = QDQGraph((2, 3, 6, 6))
    t = g.op("Conv", [g.x, g.weight((4, 3, 3, 3))], kernel_shape=[3, 3])
    t = g.op("Relu", [t])
    model = g.model(t, 0.05, 100)  # zero point 100 > qmin: Q keeps negatives the Relu removed
    folded = FoldQOperator()(model).model
    ops = _ops(folded)
    assert ops["QLinearConv"] == 1 and ops["Clip"] == 1
    assert "Conv" not in ops and "Relu" not in ops
    x = RNG.standard_normal((2, 3, 6, 6)).astype(np.float32) * 2
    lsb = _output_scale(model)
    # ORT does not fuse Conv -> Relu -> Q here (runs the conv in float): at most 1 LSB
    assert np.abs(_run_ort(folded, x) - _run_ort(model, x)).max() / lsb <= 1.0 + 1e-3


def test_not_applied_clip_wider_than_nothing_and_shared_output():
    g = QDQGraph((2, 3, 6, 6))
    conv = g.op("Conv", [g.x, g.weight((4, 3, 3, 3))], kernel_shape=[3, 3])
    clip = g.op("Clip", [conv, g.const(np.float32(0)), g.const(np.float32(1))])
    model = g.model(g.op("Add", [clip, conv]), 0.1, 0)  # conv read twice, clip inside the grid
    folded = FoldQOperator()(model).model
    assert {"Conv", "Clip", "Add"} <= set(_ops(folded))


def test_not_applied_unregistered_op_stays_qdq_and_inspect_names_it():
    assert "Softmax" not in foldable_ops()
    g = QDQGraph((2, 10))
    t = g.op("Softmax", [g.x], axis=-1)
    t = g.qdq(t, 1 / 255, 0)
    t = g.op("Sigmoid", [t])
    folded = FoldQOperator()(g.model(t, 1 / 255, 0)).model
    assert _ops(folded)["Softmax"] == 1 and _ops(folded)["QLinearSigmoid"] == 1
    report = qb.onnx.inspect_model(folded)
    assert report.form == "QDQ+QOperator"
    assert [n.split()[0] for n in report.qdq_ops] == ["Softmax"]
    assert "not folded" in report.format() and "Softmax" in report.format()


def test_not_applied_float_operand_leaves_model_unchanged():
    g = QDQGraph((2, 8))
    t = g.op("Add", [g.x, "x"])  # one operand is the float graph input itself
    model = g.model(t, 0.1)
    result = FoldQOperator()(model)
    assert not result.modified and result.model is model


# -- bad input ------------------------------------------------------------------------------------
def test_float_model_is_refused():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    model = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "f", [x], [y])
    )
    with pytest.raises(ValueError, match="float model. Quantize it first"):
        qb.fold(model)


def test_pair_with_other_scale_is_refused():
    g = QDQGraph((2, 8))
    q = g.q(g.x, 0.05, 128)
    g.dq(q, 0.07, 128)  # the partner of the Q uses another scale
    model = g.model(g.nodes[-1].output[0], 0.1)
    with pytest.raises(ValueError, match=r"scale 0\.05.*other parameters \(scale 0\.07"):
        qb.fold(model)


def test_fold_refuses_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError):
        qb.fold(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\x00\xffnot a model")
    with pytest.raises(ValueError, match="junk.onnx' is not a readable ONNX model"):
        qb.fold(tmp_path / "junk.onnx")
    with pytest.raises(TypeError, match="path or an onnx.ModelProto"):
        qb.fold(3)


def test_registry_rejects_a_second_handler():
    from quantbridge.onnx.passes import register_fold

    with pytest.raises(ValueError, match="registered twice"):
        register_fold("Conv")(lambda g, n: None)
    assert {
        "Conv",
        "Gemm",
        "MatMul",
        "Add",
        "Mul",
        "Concat",
        "AveragePool",
        "ReduceMean",
        "GlobalAveragePool",
        "Sigmoid",
        "LeakyRelu",
        "Relu",
        "Clip",
    } <= set(foldable_ops())


def test_case4_float_bias_beyond_int32_stays_qdq():
    """A float bias int32 cannot hold at input x weight scale (here 1e6 against a bias step
    ~0.05 * 0.005, int32 reaching ~5e5) is not folded (it would saturate): the Conv stays QDQ
    and the file computes exactly what it did."""
    g = QDQGraph((2, 3, 5, 5))
    b = g.const(np.array([0.1, 1e6, -0.2, 0.0], np.float32))
    t = g.op("Conv", [g.x, g.weight((4, 3, 3, 3)), b], kernel_shape=[3, 3])
    model = g.model(t, 0.1)
    folded = FoldQOperator()(model).model
    assert _ops(folded)["QLinearConv"] == 0 and _ops(folded)["Conv"] == 1
    x = RNG.standard_normal((2, 3, 5, 5)).astype(np.float32)
    np.testing.assert_array_equal(_run_ort(folded, x), _run_ort(model, x))


# -- int8 activations with uint8 weights (ONNX Runtime has no kernel for the mix) ---------------
def _u8_weight(g, shape, zero_point=130):
    """A per-tensor uint8 weight (ORT quantize_static with weight_type=QUInt8). Codes within 56
    of 128, so that shifted to int8 they stay in 7 bits (the saturating int16 pair sums of
    ``QDQGraph.weight``'s comment)."""
    w = RNG.integers(72, 185, shape).astype(np.uint8)
    return g.dq(g.const(w, "w"), 0.004, zero_point, np.uint8)


@pytest.mark.parametrize("op", ["Conv", "Gemm", "MatMul", "Linear"])
def test_int8_activations_with_uint8_weights_fold_to_int8_weights(op):
    """int8 activations, uint8 weight: ONNX Runtime 1.32 registers QLinearConv / QLinearMatMul /
    QGemm for (u8, u8|s8) and (s8, s8) only, so the weight's codes and zero point move down by 128
    (exact). The folded file loads and agrees with ONNX Runtime running the QDQ file (which runs
    the mix in float: 1 LSB, a rounding tie, as ``FLOAT_IN_ORT`` in the module docstring)."""
    shape = (2, 3, 6, 6) if op == "Conv" else (4, 16)
    g = QDQGraph(shape, zero_point=3, dtype=np.int8)
    if op == "Conv":
        t = g.op("Conv", [g.x, _u8_weight(g, (4, 3, 3, 3))], kernel_shape=[3, 3])
        expect = {"QLinearConv": 1}
    elif op == "Gemm":
        t = g.op("Gemm", [g.x, _u8_weight(g, (10, 16))], transB=1)
        expect = {"QGemm": 1}
    elif op == "MatMul":
        t, expect = g.op("MatMul", [g.x, _u8_weight(g, (16, 5))]), {"QLinearMatMul": 1}
    else:
        t = g.op("MatMul", [g.x, _u8_weight(g, (16, 12))])
        t = g.op("Add", [t, g.const((RNG.standard_normal(12) * 0.2).astype(np.float32))])
        expect = {"QGemm": 1, "Add": 0}
    model = g.model(t, 0.1, zero_point=-5, dtype=np.int8)
    folded = _fold_and_check(model, shape, expect, float_in_ort=True)
    weights = {i.name: i.data_type for i in folded.graph.initializer}
    integer_op = next(n for n in folded.graph.node if n.op_type in expect)
    assert weights[integer_op.input[3]] == TensorProto.INT8  # the shifted weight codes
    assert weights[integer_op.input[5]] == TensorProto.INT8  # and zero point (130 - 128)


@pytest.mark.parametrize(
    "zero_point, folds, act", [(128, True, np.int8), (130, False, np.int8), (128, True, np.uint8)]
)
def test_per_channel_uint8_weights(zero_point, folds, act):
    """Per channel, QLinearConv takes zero points 0 only: a symmetric uint8 weight (every zero
    point 128) moves to int8 with zero points 0 (exact, as per tensor); other zero points stay QDQ.
    Either way the file loads and agrees with ORT on the QDQ file (1 LSB: a float tie there).
    With uint8 activations the symmetric weight stays uint8 ((u8, u8) is registered and exact on
    every CPU; ``test_uint8_activations_keep_full_range_uint8_weights``)."""
    shape = (2, 3, 6, 6)
    g = QDQGraph(shape, zero_point=3 if act == np.int8 else 131, dtype=act)
    w = RNG.integers(72, 185, (4, 3, 3, 3)).astype(np.uint8)
    scales = np.array([0.004, 0.003, 0.005, 0.002], np.float32)
    zps = np.full(4, zero_point, np.uint8)
    t = g.op(
        "Conv", [g.x, g.dq(g.const(w, "w"), scales, zps, np.uint8, axis=0)], kernel_shape=[3, 3]
    )
    model = g.model(t, 0.1, zero_point=-5 if act == np.int8 else 123, dtype=act)
    if not folds:
        folded = FoldQOperator()(model).model
        assert _ops(folded)["QLinearConv"] == 0 and _ops(folded)["Conv"] == 1
        x = RNG.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(_run_ort(folded, x), _run_ort(model, x))
        return
    folded = _fold_and_check(model, shape, {"QLinearConv": 1}, float_in_ort=True)
    integer_op = next(n for n in folded.graph.node if n.op_type == "QLinearConv")
    inits = {i.name: i for i in folded.graph.initializer}
    zero = numpy_helper.to_array(inits[integer_op.input[5]])
    if act == np.uint8:  # kept: (u8, u8)
        assert inits[integer_op.input[3]].data_type == TensorProto.UINT8
        assert zero.dtype == np.uint8 and np.all(zero == 128)
        return
    assert inits[integer_op.input[3]].data_type == TensorProto.INT8  # the shifted codes
    assert zero.dtype == np.int8 and not zero.any()  # 128 - 128, per channel


@pytest.mark.parametrize("op", ["Conv", "MatMul"])
def test_uint8_activations_keep_full_range_uint8_weights(op):
    """ONNX Runtime's quantize_static(per_channel=True, weight_type=QUInt8) writes symmetric
    uint8 weights (zero points 128) with codes over all of [0, 255]. The fold used to move them to
    int8 for uint8 activations; ONNX Runtime then runs (u8, s8), which x86 CPUs without VNNI sum
    pairwise in int16 with saturation (per-channel u8u8 MiniLM-style file: 56 output steps off
    there). Kept uint8, (u8, u8) is exact on every CPU: 0 LSB against ORT's own fusion of the QDQ
    file, as every exactly-folded case (module docstring)."""
    shape = (2, 8, 6, 6) if op == "Conv" else (2, 5, 32)
    g = QDQGraph(shape, zero_point=131, dtype=np.uint8)
    w_shape, axis = ((4, 8, 3, 3), 0) if op == "Conv" else ((32, 6), 1)
    w = RNG.integers(0, 256, w_shape).astype(np.uint8)
    w.reshape(-1)[:2] = (0, 255)  # the codes' full range
    channels = w_shape[axis]
    scales = np.linspace(0.002, 0.005, channels).astype(np.float32)
    weight = g.dq(g.const(w, "w"), scales, np.full(channels, 128, np.uint8), np.uint8, axis=axis)
    kw = {"kernel_shape": [3, 3]} if op == "Conv" else {}
    t = g.op(op, [g.x, weight], **kw)
    model = g.model(t, 0.25, zero_point=123, dtype=np.uint8)
    fused = "QLinearConv" if op == "Conv" else "QLinearMatMul"
    folded = _fold_and_check(model, shape, {fused: 1}, float_in_ort=op == "MatMul")
    integer_op = next(n for n in folded.graph.node if n.op_type == fused)
    inits = {i.name: i for i in folded.graph.initializer}
    assert inits[integer_op.input[3]].data_type == TensorProto.UINT8  # the weight, as stored


def test_int8_activation_times_uint8_activation_stays_qdq():
    """QLinearMatMul of an int8 and a uint8 *activation*: no kernel, no constant to shift; the
    MatMul stays QDQ and the file still loads and computes what it did."""
    g = QDQGraph((4, 8), zero_point=0, dtype=np.int8)
    other = g.qdq(g.op("Transpose", [g.x], perm=[1, 0]), 0.05, 128, np.uint8)
    model = g.model(g.op("MatMul", [g.x, other]), 0.3, zero_point=0, dtype=np.int8)
    folded = FoldQOperator()(model).model
    assert _ops(folded)["QLinearMatMul"] == 0 and _ops(folded)["MatMul"] == 1
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_array_equal(_run_ort(folded, x), _run_ort(model, x))


def test_case3_cancelled_requantize_keeps_the_files_tensor_name():
    """``DQ -> MaxPool -> Q`` with the input's parameters (qb.export writes it): the integer
    MaxPool writes the Q's tensor name, as the folded integer ops do, so ``compare`` pairs it
    between the QDQ and the folded file (it was named ``..._int_qb`` and listed "not matched")."""
    g = QDQGraph((2, 3, 6, 6), scale=0.05, zero_point=128)
    t = g.op("Conv", [g.x, g.weight((4, 3, 3, 3))], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    conv_q = g.q(t, 0.1, 128)
    t = g.op("MaxPool", [g.dq(conv_q, 0.1, 128)], kernel_shape=[2, 2], strides=[2, 2])
    pool_q = g.q(t, 0.1, 128)
    t = g.op("Conv", [g.dq(pool_q, 0.1, 128), g.weight((4, 4, 1, 1))], kernel_shape=[1, 1])
    folded = _fold_and_check(g.model(t, 0.2), (2, 3, 6, 6), {"QLinearConv": 2, "MaxPool": 1})
    pool = next(n for n in folded.graph.node if n.op_type == "MaxPool")
    assert list(pool.input) == [conv_q] and list(pool.output) == [pool_q]


def test_folding_a_folded_model_says_so():
    # not applied: a second fold found nothing and wrote the file back silently (session 13).
    # Last in the file: it draws weights from the shared RNG, which later cases' data depend on
    g = QDQGraph((2, 8, 7, 7))
    w = g.weight((8, 8, 3, 3))
    once = qb.fold(g.model(g.op("Conv", [g.x, w], kernel_shape=[3, 3]), 0.1))
    with pytest.warns(UserWarning, match=r"already folded \(QLinearConv\): nothing left to fold"):
        twice = qb.fold(once)
    assert twice.graph == once.graph


@pytest.mark.parametrize("dtype", [TensorProto.INT4, TensorProto.UINT4])
def test_not_applied_four_bit_codes_stay_behind_their_dequantize(dtype):
    """Case 1 does not move 4-bit codes: ONNX Runtime 1.32 has no int4 / uint4 Identity,
    Reshape, Transpose ... kernel. ORT's quantize_static(weight_type=QInt4) shares one LayerNorm
    weight through Identity nodes; the fold sank the weight's DQ below them and the folded file
    failed to load ("Type 'tensor(int4)' of input parameter ... of operator (Identity) ... is
    invalid"; import sweep, 2026-12-03). 4-bit weights are not folded (no QOperator op takes
    them): the model keeps its QDQ form and ORT computes the same, 0 LSB."""
    g = QDQGraph((2, 16), opset=21)
    low, high = (-8, 8) if dtype == TensorProto.INT4 else (0, 16)
    codes = RNG.integers(low, high, (16, 4))
    w = helper.make_tensor("w4", dtype, [16, 4], codes.reshape(-1).tolist())
    zp = helper.make_tensor("w4_zp", dtype, [], [0 if dtype == TensorProto.INT4 else 8])
    g.inits += [w, zp]
    weight = g.op("DequantizeLinear", ["w4", g.const(np.float32(0.02)), "w4_zp"])
    shared = g.op("Identity", [weight])
    model = g.model(g.op("MatMul", [g.x, shared]), 0.1, 128)
    folded = FoldQOperator()(model).model
    onnx.checker.check_model(folded, full_check=True)
    users = {n.op_type for n in folded.graph.node if "w4" in n.input}
    assert users == {"DequantizeLinear"}, users
    x = RNG.standard_normal((2, 16)).astype(np.float32)
    np.testing.assert_array_equal(_run_ort(folded, x), _run_ort(model, x))
