"""``import_onnx`` on hand-written quantized graphs: every QDQ form the issue lists (int8, uint8,
int16, int4 / uint4 at opset 21, Constant-node scales, Q -> Clip -> DQ, initializers listed as
graph inputs), each against ONNX Runtime on the same file; and the bad inputs, each refused with
the node and the fix, before anything is built."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb

_NP = {
    TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8, TensorProto.INT16: np.int16,
    TensorProto.UINT16: np.uint16, TensorProto.INT4: np.int8, TensorProto.UINT4: np.uint8,
}  # fmt: skip


def _tensor(name, values, onnx_type):
    values = np.asarray(values)
    if onnx_type in (TensorProto.INT4, TensorProto.UINT4):
        return helper.make_tensor(name, onnx_type, values.shape, values.reshape(-1).tolist())
    return numpy_helper.from_array(values.astype(_NP[onnx_type]), name)


def _conv_qdq(
    act=TensorProto.UINT8, weight=TensorProto.INT8, opset=13, clip=None, constant_nodes=False,
    inits_as_inputs=False, dq_scale=None, x_scale=0.05, x_zero=None,
) -> onnx.ModelProto:  # fmt: skip
    """x -> Q -> [Clip] -> DQ -> Conv(DQ(w int, per channel), DQ(b int32)) -> Q -> DQ -> y."""
    rng = np.random.default_rng(0)
    lo, hi = {TensorProto.UINT8: (0, 255), TensorProto.INT8: (-128, 127),
              TensorProto.INT16: (-32768, 32767), TensorProto.UINT16: (0, 65535),
              TensorProto.INT4: (-8, 7), TensorProto.UINT4: (0, 15)}[weight]  # fmt: skip
    w = rng.integers(max(lo, -7), min(hi, 7) + 1, size=(4, 3, 3, 3))
    w_scale = rng.uniform(0.01, 0.03, 4).astype(np.float32)
    x_zero = (
        (0 if act in (TensorProto.INT8, TensorProto.INT16, TensorProto.INT4) else 8)
        if x_zero is None
        else x_zero
    )
    y_scale, y_zero = (
        np.float32(0.1),
        3 if act in (TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT4) else -2,
    )
    x_scale = np.float32(x_scale)
    b_scale = (x_scale * w_scale).astype(np.float32)
    b = rng.integers(-500, 500, 4).astype(np.int32)
    w_zero = (
        np.zeros(4, np.int64)
        if weight in (TensorProto.INT8, TensorProto.INT16, TensorProto.INT4)
        else np.full(4, 8)
    )
    consts = {
        "xs": numpy_helper.from_array(x_scale, "xs"), "xz": _tensor("xz", x_zero, act),
        "ys": numpy_helper.from_array(y_scale, "ys"), "yz": _tensor("yz", y_zero, act),
        "w": _tensor("w", w, weight), "ws": numpy_helper.from_array(w_scale, "ws"),
        "wz": _tensor("wz", w_zero, weight), "b": numpy_helper.from_array(b, "b"),
        "bs": numpy_helper.from_array(b_scale, "bs"),
        "dqs": numpy_helper.from_array(np.float32(dq_scale or x_scale), "dqs"),
    }  # fmt: skip
    q_out = "xq"
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q_x")]
    if clip is not None:
        consts["lo"], consts["hi"] = _tensor("lo", clip[0], act), _tensor("hi", clip[1], act)
        nodes.append(helper.make_node("Clip", ["xq", "lo", "hi"], ["xc"], name="clip_x"))
        q_out = "xc"
    nodes += [
        helper.make_node("DequantizeLinear", [q_out, "dqs", "xz"], ["xd"], name="dq_x"),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], name="dq_w", axis=0),
        helper.make_node("DequantizeLinear", ["b", "bs"], ["bd"], name="dq_b", axis=0),
        helper.make_node("Conv", ["xd", "wd", "bd"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["cq"], name="q_y"),
        helper.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["y"], name="dq_y"),
    ]
    inits = list(consts.values())
    if constant_nodes:  # scales and zero points as Constant nodes, as some exporters write them
        keep = {"w", "b", "wz"}
        nodes = [
            helper.make_node("Constant", [], [k], value=v)
            for k, v in consts.items()
            if k not in keep
        ] + nodes
        inits = [v for k, v in consts.items() if k in keep]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 6, 6])]
    if inits_as_inputs:  # older exporters list every initializer as a graph input too
        inputs += [helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in inits]
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 6, 6])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


FORMS = {
    "uint8/int8": {},
    "int8/int8": {"act": TensorProto.INT8},
    "uint8/uint8": {"weight": TensorProto.UINT8},
    "int16/int16 opset 21": {"act": TensorProto.INT16, "weight": TensorProto.INT16, "opset": 21},
    "uint16 opset 21": {"act": TensorProto.UINT16, "opset": 21},
    "int4/int4 opset 21": {"act": TensorProto.INT4, "weight": TensorProto.INT4, "opset": 21, "x_scale": 0.5},
    "uint4/uint4 opset 21": {"act": TensorProto.UINT4, "weight": TensorProto.UINT4, "opset": 21, "x_scale": 0.5},
    "Q -> Clip -> DQ (uint4 in uint8)": {"clip": (0, 15), "x_scale": 0.5, "x_zero": 8},
    "Q -> Clip -> DQ (int8 narrow)": {"act": TensorProto.INT8, "clip": (-127, 127)},
    "Constant-node scales": {"constant_nodes": True},
    "initializers as graph inputs": {"inits_as_inputs": True},
}  # fmt: skip


@pytest.mark.parametrize("form", list(FORMS))
def test_qdq_form_matches_ort(form):
    model = _conv_qdq(**FORMS[form])
    onnx.checker.check_model(model)
    x = np.random.default_rng(1).normal(0, 2, (3, 3, 6, 6)).astype(np.float32)
    qmodel = qb.import_onnx(model)
    with torch.no_grad():
        y = qmodel(torch.from_numpy(x)).numpy()
    expected = _ort(model, x)
    # 0 steps: one conv, the same float32 products; measured equal on every element
    steps = np.abs(y - expected) / 0.1
    assert steps.max() <= 1.0 + 1e-3 and (steps > 1e-3).mean() <= 0.01, steps.max()
    weight = next(q for q in qmodel.quantizers().values() if getattr(q, "kind", "") == "weight")
    assert weight.axis == 0 and weight.scale.shape == (4,)
    assert any(type(q).__name__ == "BiasQuantizer" for q in qmodel.quantizers().values())


def test_clip_narrows_the_quantizer_grid():
    qmodel = qb.import_onnx(_conv_qdq(clip=(0, 15), x_scale=0.5, x_zero=8))
    x_q = qmodel.quantizers()["x"]
    assert (x_q.qmin, x_q.qmax, x_q.scheme.bits, x_q.scheme.signed) == (0, 15, 4, False)


def test_learn_scales_makes_the_file_scales_learnable():
    qmodel = qb.import_onnx(_conv_qdq(), learn_scales=True)
    x_q = qmodel.quantizers()["x"]
    assert x_q.learnable and torch.allclose(x_q.log_scale.exp(), torch.tensor(0.05))
    qmodel.train()
    x = torch.randn(2, 3, 6, 6)
    qmodel(x).sum().backward()
    assert x_q.log_scale.grad is not None and x_q.log_scale.grad.abs() > 0


# -- bad input ------------------------------------------------------------------------------------
def test_dq_scale_differing_from_its_q_is_refused():
    with pytest.raises(
        ValueError, match=r"'dq_x'.*reads 'xq' with scale 0\.06 .*'q_x'.*0\.05 .*fix"
    ):
        qb.import_onnx(_conv_qdq(dq_scale=0.06))


@pytest.mark.parametrize("scale", [0.0, -0.05, float("inf")])
def test_bad_scale_is_refused(scale):
    with pytest.raises(ValueError, match=r"'q_x'.*not positive and finite"):
        qb.import_onnx(_conv_qdq(x_scale=scale))


def test_zero_point_outside_the_clipped_range_is_refused():
    with pytest.raises(
        ValueError, match=r"'clip_x'.*zero point \[100\].*outside the clipped range \[0, 15\]"
    ):
        qb.import_onnx(_conv_qdq(clip=(0, 15), x_zero=100))


def _replace_initializer(model: onnx.ModelProto, name: str, value: np.ndarray) -> None:
    (old,) = [i for i in model.graph.initializer if i.name == name]
    old.CopyFrom(numpy_helper.from_array(value, name))


def test_one_bad_per_channel_weight_scale_is_refused_naming_the_node():
    model = _conv_qdq()
    _replace_initializer(model, "ws", np.array([0.02, 0.0, 0.01, 0.02], np.float32))
    with pytest.raises(ValueError, match=r"'dq_w'.*scale \[0\.0\] is not positive.*re-quantize"):
        qb.import_onnx(model)


def test_zero_point_of_another_type_than_the_weight_is_refused():
    model = _conv_qdq()
    _replace_initializer(model, "wz", np.zeros(4, np.uint8))  # int8 codes, uint8 zero point
    with pytest.raises(ValueError, match=r"'dq_w'.*'w' has element type int8 .* UINT8.*equal"):
        qb.import_onnx(model)


def test_per_channel_zero_points_of_another_length_are_refused():
    model = _conv_qdq()
    _replace_initializer(model, "wz", np.zeros(3, np.int8))
    with pytest.raises(ValueError, match=r"'dq_w'.*zero point shape \(3,\) differs.*\(4,\)"):
        qb.import_onnx(model)


def test_not_onnx_and_truncated_files_are_refused(tmp_path):
    good = _conv_qdq().SerializeToString()
    for name, data in (
        ("garbage.onnx", b"not an onnx model " * 20),
        ("cut.onnx", good[: len(good) // 2]),
    ):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match="not a readable ONNX model.*truncated"):
            qb.import_onnx(tmp_path / name)


def test_missing_external_data_is_refused(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save_model(
        _conv_qdq(), str(path), save_as_external_data=True, location="m.data", size_threshold=0
    )
    (tmp_path / "m.data").unlink()
    with pytest.raises(
        ValueError, match="external data files that cannot be read.*next to the model"
    ):
        qb.import_onnx(path)


def test_unsupported_ops_are_listed_together():
    model = _conv_qdq()
    extra = [
        helper.make_node("Add", ["cq", "cq"], ["bad_add"], name="int_add"),  # integer arithmetic
        helper.make_node("QAttention", ["xq"], ["att"], name="att", domain="com.microsoft"),
    ]
    model.graph.node.extend(extra)
    with pytest.raises(ValueError) as err:
        qb.import_onnx(model)
    message = str(err.value)
    assert "Add (e.g. node 'int_add')" in message and "com.microsoft.QAttention" in message


def _contrib_matmul(op: str) -> onnx.ModelProto:
    """DynamicQuantizeMatMul(x, w, w_scale, w_zp, bias), or DynamicQuantizeLinear(x) ->
    MatMulIntegerToFloat(y, w, y_scale, w_scale, y_zp, w_zp, bias); per-column weight scales."""
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.integers(-60, 60, (8, 5)).astype(np.int8), "w"),
        numpy_helper.from_array(rng.uniform(0.01, 0.02, 5).astype(np.float32), "ws"),
        numpy_helper.from_array(np.zeros(5, np.int8), "wz"),
        numpy_helper.from_array(rng.normal(0, 0.1, 5).astype(np.float32), "bias"),
    ]
    ms = "com.microsoft"
    if op == "DynamicQuantizeMatMul":
        nodes = [helper.make_node(op, ["x", "w", "ws", "wz", "bias"], ["y"], name="mm", domain=ms)]
    else:
        nodes = [
            helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dql"),
            helper.make_node(op, ["xq", "w", "xs", "ws", "xz", "wz", "bias"], ["y"], name="mm", domain=ms),
        ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5])], inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid(ms, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


@pytest.mark.parametrize("op", ["DynamicQuantizeMatMul", "MatMulIntegerToFloat"])
def test_contrib_dynamic_matmul_matches_ort(op):
    model = _contrib_matmul(op)
    x = np.random.default_rng(4).normal(0, 1, (6, 8)).astype(np.float32)
    qmodel = qb.import_onnx(model)
    with torch.no_grad():
        y = qmodel(torch.from_numpy(x)).numpy()
    expected = _ort(model, x)
    # float output: float32 rounding of the same products (measured <= 1e-7 relative)
    assert np.abs(y - expected).max() <= 1e-5 * np.abs(expected).max()


def _qoperator_unary(op: str, **attrs) -> onnx.ModelProto:
    """x -> QuantizeLinear -> <op> (com.microsoft, uint8) -> DequantizeLinear -> y; QLinearConcat
    joins the quantized x with itself at another scale through a Transpose."""
    ms = "com.microsoft"
    inits = [
        numpy_helper.from_array(np.float32(0.04), "xs"), numpy_helper.from_array(np.uint8(120), "xz"),
        numpy_helper.from_array(np.float32(0.01), "ys"), numpy_helper.from_array(np.uint8(5), "yz"),
    ]  # fmt: skip
    args = ["xq", "xs", "xz", "ys", "yz"]
    if op == "QLinearConcat":
        args = ["ys", "yz", "xq", "xs", "xz", "xt", "xs", "xz"]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q"),
        helper.make_node("Transpose", ["xq"], ["xt"], name="t", perm=[0, 1, 3, 2]),
        helper.make_node(op, args, ["yq"], name="op", domain=ms, **attrs),
        helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"], name="dq"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid(ms, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


@pytest.mark.parametrize(
    "op,attrs",
    [
        ("QLinearSigmoid", {}),
        ("QLinearLeakyRelu", {"alpha": 0.1}),
        ("QLinearAveragePool", {"kernel_shape": [2, 2], "strides": [2, 2]}),
        ("QLinearGlobalAveragePool", {}),
        ("QLinearConcat", {"axis": 1}),
    ],
)
def test_qoperator_unary_ops_match_ort(op, attrs):
    """ORT computes these on dequantized values (lookup tables, float averages) and rounds once:
    within 1 step on every element (measured: equal except at rounding ties)."""
    model = _qoperator_unary(op, **attrs)
    x = np.random.default_rng(5).normal(0, 1.5, (2, 3, 6, 6)).astype(np.float32)
    qmodel = qb.import_onnx(model)
    with torch.no_grad():
        y = qmodel(torch.from_numpy(x)).numpy()
    expected = _ort(model, x)
    steps = np.abs(y - expected) / 0.01
    assert y.shape == expected.shape and steps.max() <= 1.0 + 1e-3, steps.max()
    assert (steps > 1e-3).mean() <= 0.01, (steps > 1e-3).mean()


def test_export_of_a_dynamic_import_writes_dynamic_quantize_linear(tmp_path):
    """The dynamic quantizer survives export as DynamicQuantizeLinear -> DequantizeLinear (it was
    refused before); ORT runs the file with the import's outputs up to float32 rounding (the
    import sums dequantized values in float32, ORT too here: 1e-5 of the largest output)."""
    model = _contrib_matmul("DynamicQuantizeMatMul")
    qmodel = qb.import_onnx(model)
    x = torch.randn(6, 8)
    qb.export(qmodel, tmp_path / "m.onnx", example_inputs=x)
    out = onnx.load(str(tmp_path / "m.onnx"))
    assert [n.op_type for n in out.graph.node][:2] == ["DynamicQuantizeLinear", "DequantizeLinear"]
    with torch.no_grad():
        y = qmodel(x).numpy()
    got = _ort(out, x.numpy())
    assert np.abs(got - y).max() <= 1e-5 * np.abs(y).max()
