"""Property tests of the two exactness claims of the fold, against ``numerics`` as the oracle.

* Case 13: a Relu/Clip in front of a QuantizeLinear is absorbed exactly when it changes no
  quantized value: ``absorbed(...)`` must equal ``all(Q(clip(x)) == Q(x))`` over x values that
  include both bounds, their float32 neighbours, the grid's half-steps and +-1e9.
* Case 14: the integer Clip that replaces ``DQ -> Clip -> Q`` gives ``Q(clip(DQ(q)))`` for every
  code q of the type (all 256), run by ``onnx.reference`` on the folded graph.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from quantbridge.numerics import dequantize, quantize
from quantbridge.onnx.passes import FoldQOperator
from quantbridge.onnx.passes._graph import GraphView
from quantbridge.onnx.passes._match import absorbed

_TYPES = {
    "uint8": (np.uint8, TensorProto.UINT8, 0, 255),
    "int8": (np.int8, TensorProto.INT8, -128, 127),
}

scales = st.floats(0.0009765625, 0.5, width=32)  # 2**-10 .. 0.5
bounds = st.one_of(st.none(), st.floats(-8.0, 8.0, width=32))


def _clip_qdq(lo, hi, scale, zero_point, kind):
    """x -> Q -> DQ -> Clip(lo, hi) -> Q -> DQ -> y, one set of parameters (opset 19)."""
    dtype = _TYPES[kind][0]
    inits = [numpy_helper.from_array(np.float32(scale), "s"),
             numpy_helper.from_array(dtype(zero_point), "z")]  # fmt: skip
    clip_inputs = ["d0"]
    for name, bound in (("lo", lo), ("hi", hi)):
        clip_inputs.append(name if bound is not None else "")
        if bound is not None:
            inits.append(numpy_helper.from_array(np.float32(bound), name))
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q0"]),
        helper.make_node("DequantizeLinear", ["q0", "s", "z"], ["d0"]),
        helper.make_node("Clip", clip_inputs, ["c"], name="clip"),
        helper.make_node("QuantizeLinear", ["c", "s", "z"], ["q1"]),
        helper.make_node("DequantizeLinear", ["q1", "s", "z"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "clip", [helper.make_tensor_value_info("x", 1, [256])],
                              [helper.make_tensor_value_info("y", 1, [256])], inits)  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 10
    return model


@settings(max_examples=150, deadline=None)
@given(
    lo=bounds,
    hi=bounds,
    scale=scales,
    zp=st.integers(-128, 255),
    kind=st.sampled_from(sorted(_TYPES)),
)
def test_case13_absorbed_iff_no_code_changes(lo, hi, scale, zp, kind):
    _, _, qmin, qmax = _TYPES[kind]
    zp = int(np.clip(zp, qmin, qmax))
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    g = GraphView.of(_clip_qdq(lo, hi, scale, zp, kind))
    clip = next(n for n in g.nodes if n.op_type == "Clip")
    quantizer = next(n for n in g.nodes if n.op_type == "QuantizeLinear" and n.input[0] == "c")
    params = g.qparams(quantizer)
    grid = (np.arange(qmin, qmax + 1, dtype=np.float32) - zp) * np.float32(scale)
    xs = [grid, grid + np.float32(scale) / 2, np.float32([1e9, -1e9, 0.0])]
    for b in (lo, hi):
        if b is not None:
            b = np.float32(b)
            xs.append(
                np.float32([b, np.nextafter(b, np.float32(-np.inf)), np.nextafter(b, np.inf)])
            )
    x = np.concatenate(xs).astype(np.float32)
    clipped = np.clip(
        x, -np.inf if lo is None else np.float32(lo), np.inf if hi is None else np.float32(hi)
    )
    same = np.array_equal(
        quantize(clipped, scale, zp, qmin, qmax), quantize(x, scale, zp, qmin, qmax)
    )
    assert absorbed(g, clip, params) == same


@settings(max_examples=60, deadline=None)
@given(
    lo=bounds,
    hi=bounds,
    scale=scales,
    zp=st.integers(-128, 255),
    kind=st.sampled_from(sorted(_TYPES)),
)
def test_case14_integer_clip_is_exact_for_every_code(lo, hi, scale, zp, kind):
    _, _, qmin, qmax = _TYPES[kind]
    zp = int(np.clip(zp, qmin, qmax))
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    model = _clip_qdq(lo, hi, scale, zp, kind)
    folded = FoldQOperator()(model).model
    assert [n.op_type for n in folded.graph.node] == ["QuantizeLinear", "Clip", "DequantizeLinear"]
    codes = np.arange(qmin, qmax + 1, dtype=np.float32)
    x = dequantize(codes, scale, zp)  # the input Q gives back exactly these codes
    lo_ = -np.inf if lo is None else np.float32(lo)
    hi_ = np.inf if hi is None else np.float32(hi)
    expected = dequantize(quantize(np.clip(x, lo_, hi_), scale, zp, qmin, qmax), scale, zp)
    got = ReferenceEvaluator(folded).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, expected)
