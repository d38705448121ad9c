"""Differential tests against ONNX: onnx.reference and a real ONNX Runtime session of a
one-node QuantizeLinear / DequantizeLinear model must agree bit for bit with our functions."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from quantbridge.numerics import dequantize, quantize

F32 = np.float32

# ONNX element type -> (qmin, qmax, numpy container fed to / read from the session).
TYPES = {
    TensorProto.INT8: (-128, 127, np.int8),
    TensorProto.UINT8: (0, 255, np.uint8),
    TensorProto.INT16: (-32768, 32767, np.int16),
    TensorProto.UINT16: (0, 65535, np.uint16),
    TensorProto.INT4: (-8, 7, np.int8),
    TensorProto.UINT4: (0, 15, np.uint8),
}
SUB_BYTE = {TensorProto.INT4, TensorProto.UINT4}
# (type, opset): ONNX Runtime runs int8/uint8 Q/DQ from opset 13; int16/uint16/int4/uint4 need 21.
CASES = [
    (TensorProto.INT8, 13),
    (TensorProto.UINT8, 13),
    (TensorProto.INT8, 21),
    (TensorProto.UINT8, 21),
    (TensorProto.INT16, 21),
    (TensorProto.UINT16, 21),
    (TensorProto.INT4, 21),
    (TensorProto.UINT4, 21),
]
AXES = [None, 0, 1, -1]
SHAPE = (6, 5, 40)


def _ids(case):
    return f"{TensorProto.DataType.Name(case[0])}-opset{case[1]}"


def _model(op, qtype, opset, scale, zero_point, axis):
    """One Q or DQ node. Sub-byte codes cannot cross the numpy boundary, so they go through an
    in-graph Cast to/from int8/uint8 (exact: every int4/uint4 value fits)."""
    container = {TensorProto.INT4: TensorProto.INT8, TensorProto.UINT4: TensorProto.UINT8}.get(
        qtype, qtype
    )
    inits = [
        helper.make_tensor("scale", TensorProto.FLOAT, scale.shape, scale.ravel().tolist()),
        helper.make_tensor("zp", qtype, zero_point.shape, zero_point.ravel().tolist()),
    ]
    attrs = {} if axis is None else {"axis": axis}
    q_info = helper.make_tensor_value_info("q", container, None)
    f_info = helper.make_tensor_value_info("f", TensorProto.FLOAT, None)
    if op == "QuantizeLinear":
        nodes = [helper.make_node(op, ["f", "scale", "zp"], ["q_raw"], **attrs)]
        nodes.append(helper.make_node("Cast", ["q_raw"], ["q"], to=container))
        inputs, outputs = [f_info], [q_info]
    else:
        nodes = [helper.make_node("Cast", ["q"], ["q_typed"], to=qtype)]
        nodes.append(helper.make_node(op, ["q_typed", "scale", "zp"], ["f"], **attrs))
        inputs, outputs = [q_info], [f_info]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _seed(qtype, opset, axis, test):
    return [qtype, opset, 9 if axis is None else axis + 5, test]


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _params(rng, qtype, axis):
    qmin, qmax, _ = TYPES[qtype]
    n = 1 if axis is None else SHAPE[axis]
    scale = (10.0 ** rng.uniform(-3, 1, n)).astype(F32)
    zero_point = rng.integers(qmin, qmax + 1, n)
    if axis is None:
        return scale.reshape(()), zero_point.reshape(())
    return scale, zero_point


def _data(rng, scale, zero_point, qmin, qmax, axis, edges):
    """Values spread over ~3x the grid, plus exact ties; with ``edges``, also +-inf and +-3e9."""
    span = max(qmax - qmin, 4)
    steps = rng.integers(-span, span, SHAPE) + rng.choice([0.0, 0.5, 0.25, 0.7], SHAPE)
    shape = [1] * len(SHAPE)
    if axis is not None:
        shape[axis] = -1
    x = (steps * scale.reshape(shape)).astype(F32)
    if edges:
        x.reshape(-1)[:4] = [np.inf, -np.inf, 3e9, -3e9]
    return x


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("axis", AXES)
def test_quantize_matches_onnxruntime(case, axis):
    qtype, opset = case
    qmin, qmax, container = TYPES[qtype]
    rng = np.random.default_rng(_seed(qtype, opset, axis, 0))
    scale, zero_point = _params(rng, qtype, axis)
    x = _data(rng, scale, zero_point, qmin, qmax, axis, edges=True)
    ours = quantize(x, scale, zero_point, qmin, qmax, axis).astype(container)
    model = _model("QuantizeLinear", qtype, opset, scale, zero_point, axis)
    (theirs,) = _session(model).run(None, {"f": x})
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("axis", AXES)
def test_quantize_matches_onnx_reference(case, axis):
    qtype, opset = case
    qmin, qmax, container = TYPES[qtype]
    rng = np.random.default_rng(_seed(qtype, opset, axis, 1))
    scale, zero_point = _params(rng, qtype, axis)
    # No +-inf / 3e9 here: onnx.reference casts x / scale to int32 *before* clipping, so values
    # beyond int32 wrap (inf -> INT32_MIN -> qmin). ORT is the oracle for those (test above).
    x = _data(rng, scale, zero_point, qmin, qmax, axis, edges=False)
    ours = quantize(x, scale, zero_point, qmin, qmax, axis).astype(container)
    model = _model("QuantizeLinear", qtype, opset, scale, zero_point, axis)
    (theirs,) = ReferenceEvaluator(model).run(None, {"f": x})
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("axis", AXES)
def test_dequantize_matches_onnxruntime_and_reference(case, axis):
    qtype, opset = case
    qmin, qmax, container = TYPES[qtype]
    rng = np.random.default_rng(_seed(qtype, opset, axis, 2))
    scale, zero_point = _params(rng, qtype, axis)
    q = rng.integers(qmin, qmax + 1, SHAPE).astype(container)
    q.reshape(-1)[:2] = [qmin, qmax]
    ours = dequantize(q, scale, zero_point, axis)
    model = _model("DequantizeLinear", qtype, opset, scale, zero_point, axis)
    (ort_out,) = _session(model).run(None, {"q": q})
    # onnx.reference implements DequantizeLinear from version 19 on (same formula for int8/uint8).
    ref_model = _model("DequantizeLinear", qtype, max(opset, 19), scale, zero_point, axis)
    (ref_out,) = ReferenceEvaluator(ref_model).run(None, {"q": q})
    assert ours.dtype == ort_out.dtype == F32
    np.testing.assert_array_equal(ours.view(np.uint32), ort_out.view(np.uint32))
    np.testing.assert_array_equal(ours.view(np.uint32), ref_out.view(np.uint32))


@pytest.mark.parametrize("qtype", [TensorProto.INT8, TensorProto.UINT8, TensorProto.INT4])
def test_ties_and_saturation_golden_match_onnxruntime(qtype):
    qmin, qmax, container = TYPES[qtype]
    scale, zero_point = np.array(0.25, F32), np.array(qmin + 3)  # pow2 scale: exact ties
    steps = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 1e3, -1e3], F32)
    x = np.concatenate([steps * scale, np.array([np.inf, -np.inf, 3e9, -3e9], F32)])
    model = _model("QuantizeLinear", qtype, 21, scale, zero_point, None)
    (theirs,) = _session(model).run(None, {"f": x})
    expected = np.clip(np.array([0, 2, 2, 0, -2, -2, 4, 1e3, -1e3]) + qmin + 3, qmin, qmax)
    np.testing.assert_array_equal(theirs[:9], expected)
    np.testing.assert_array_equal(theirs[9:], [qmax, qmin, qmax, qmin])
    np.testing.assert_array_equal(
        quantize(x, scale, zero_point, qmin, qmax).astype(container), theirs
    )


@pytest.mark.parametrize("qtype", [TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16])
def test_onnxruntime_nan_policy_differs_from_ours(qtype):
    """Documented divergence: ORT (1.32, CPU) maps NaN to the type minimum whatever the zero
    point; we map NaN to the zero point (it dequantizes to 0.0). If ORT changes, revisit the
    NaN policy note in ``quantize``'s docstring."""
    qmin, qmax, container = TYPES[qtype]
    scale, zero_point = np.array(0.5, F32), np.array(3)
    x = np.full(17, np.nan, F32)  # 17: exercises both the vectorised body and the scalar tail
    model = _model("QuantizeLinear", qtype, 21, scale, zero_point, None)
    (theirs,) = _session(model).run(None, {"f": x})
    np.testing.assert_array_equal(theirs, np.full(17, np.iinfo(container).min))
    np.testing.assert_array_equal(quantize(x, scale, zero_point, qmin, qmax), np.full(17, 3))
