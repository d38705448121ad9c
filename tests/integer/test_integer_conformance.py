"""Conformance: ONNX's own node test cases (``onnx.backend.test.case.node``) for QLinearConv,
QLinearMatMul, ConvInteger, MatMulInteger, QuantizeLinear and DequantizeLinear run through the
lowering and the numpy executor; random cases of the four integer operators against
``onnx.reference.ReferenceEvaluator``.

The data operand (x / a) stays a graph input; the other inputs (scales, zero points, weights)
become initializers, as in a deployed model. Cases outside the program's types are listed in
``OUT_OF_SCOPE`` with the reason: float8 / 4-bit / 2-bit codes, per-axis or blocked activation
quantization (activations are per tensor in the program).
"""

from __future__ import annotations

import importlib
import warnings

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import quantbridge as qb

OPS = ("QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger", "QuantizeLinear",
       "DequantizeLinear")  # fmt: skip
CODE_TYPES = {np.dtype(t) for t in ("uint8", "int8", "uint16", "int16")}


def _cases() -> dict[str, object]:
    """Import only the six case modules (``collect_testcases`` builds every op's cases: ~40 s);
    importing a module registers its cases in ``node._NodeTestCases``."""
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in OPS:
            importlib.import_module(f"onnx.backend.test.case.node.{op.lower()}")
    return {c.name: c for c in node._NodeTestCases if c.model.graph.node[0].op_type in OPS}


CASES = _cases()


def _out_of_scope(case) -> str | None:
    node = case.model.graph.node[0]
    inputs, _ = case.data_sets[0]
    per_axis = node.op_type in ("QuantizeLinear", "DequantizeLinear") and np.size(inputs[1]) > 1
    if per_axis or any(a.name == "block_size" for a in node.attribute):
        return "per-axis / blocked quantization of an activation"
    codes = inputs[0] if node.op_type != "QuantizeLinear" else case.data_sets[0][1][0]
    dtype = getattr(codes, "dtype", type(codes).__name__)
    if dtype not in CODE_TYPES:
        return f"{dtype} codes"
    return None


OUT_OF_SCOPE = {name: r for name, c in CASES.items() if (r := _out_of_scope(c)) is not None}


def _with_initializers(model: onnx.ModelProto, inputs: list[np.ndarray], keep: int = 1):
    """The case's model with every input after the first ``keep`` turned into an initializer."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    graph_inputs = list(m.graph.input)
    del m.graph.input[:]
    m.graph.input.extend(graph_inputs[:keep])
    for vi, value in zip(graph_inputs[keep:], inputs[keep:], strict=True):
        m.graph.initializer.append(numpy_helper.from_array(value, vi.name))
    feeds = {vi.name: v for vi, v in zip(graph_inputs[:keep], inputs[:keep], strict=True)}
    return m, feeds


@pytest.mark.parametrize("name", sorted(set(CASES) - set(OUT_OF_SCOPE)))
def test_onnx_node_case(name):
    case = CASES[name]
    for inputs, expected in case.data_sets:
        model, feeds = _with_initializers(case.model, inputs)
        prog = qb.lower(model)
        got = list(prog.run(feeds).values())
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == e.dtype and g.shape == e.shape
            np.testing.assert_array_equal(g, e)


def test_out_of_scope_cases_are_the_exotic_types():
    assert len(set(CASES) - set(OUT_OF_SCOPE)) >= 15, sorted(set(CASES) - set(OUT_OF_SCOPE))
    assert all(("codes" in r) or ("per-axis" in r) for r in OUT_OF_SCOPE.values())


def _random_model(op: str, rng: np.random.Generator):
    """A random QLinearConv / QLinearMatMul / ConvInteger / MatMulInteger with its feeds."""
    u8 = rng.random() < 0.5
    dtype = np.uint8 if u8 else np.int8
    lo, hi = (0, 256) if u8 else (-128, 128)

    def codes(shape, dt=dtype, a=lo, b=hi):
        return rng.integers(a, b, size=shape).astype(dt)

    scale = lambda: np.float32(rng.uniform(0.001, 0.1))  # noqa: E731
    if op in ("QLinearConv", "ConvInteger"):
        c, o, k, group = 4, 6, int(rng.integers(1, 4)), int(rng.choice([1, 2]))
        x = codes((2, c, 7, 8))
        w = codes((o, c // group, k, k), np.int8, -127, 128)
        attrs = {"group": group, "pads": [k // 2] * 4, "strides": [int(rng.integers(1, 3))] * 2}
    else:
        x, w, attrs = codes((2, 3, 5)), codes((5, 4), np.int8, -127, 128), {}
    xz, wz = codes(()), np.int8(0)
    if op == "QLinearConv":
        wscale = (rng.uniform(0.001, 0.05, w.shape[0])).astype(np.float32)
        wz = np.zeros(w.shape[0], np.int8)
        bias = rng.integers(-5000, 5000, size=w.shape[0]).astype(np.int32)
        ins = [x, scale(), xz, w, wscale, wz, np.float32(rng.uniform(0.05, 0.5)), codes(()), bias]
    elif op == "QLinearMatMul":
        ins = [x, scale(), xz, w, scale(), wz, np.float32(rng.uniform(0.01, 0.2)), codes(())]
    else:
        ins = [x, w, xz, wz]
    names = [f"in{i}" for i in range(len(ins))]
    node = helper.make_node(op, names, ["y"], **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in zip(names, ins, strict=True)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.UNDEFINED, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return model, ins


@pytest.mark.parametrize("op", ["QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger"])
def test_random_cases_agree_with_reference_evaluator(op):
    """Integer outputs (ConvInteger, MatMulInteger) exactly; QLinear outputs within one code,
    differing only where the reference's float requantization meets a tie (it rounds
    ``acc * (s_x s_w / s_y)`` in float32; the program rounds the exact product once)."""
    rng = np.random.default_rng(0)
    differ = total = 0
    for _ in range(20):
        model, ins = _random_model(op, rng)
        (expected,) = ReferenceEvaluator(model).run(None, {f"in{i}": v for i, v in enumerate(ins)})
        m, feeds = _with_initializers(model, ins)
        (got,) = qb.lower(m).run(feeds).values()
        assert got.dtype == expected.dtype and got.shape == expected.shape
        d = np.abs(got.astype(np.int64) - expected.astype(np.int64))
        assert d.max() <= (0 if op.endswith("Integer") else 1)
        differ, total = differ + int((d > 0).sum()), total + d.size
    assert differ / total <= 0.01
