"""Each lowered op family against ONNX Runtime's float QDQ path, layer by layer.

ORT runs DequantizeLinear -> op -> QuantizeLinear in float32 (graph optimizations off, so no
integer kernel of its own); the program runs integers and one fixed-point rounding. They agree
exactly except where ORT's float32 result lies within float32 rounding error of a half-way point
(both round exact ties to even): never more than 1 code, and
rarely (bound: 2% of codes on these small random layers; measured 0-0.4%).
"""

from __future__ import annotations

import numpy as np
import pytest

import quantbridge as qb


def _check(model, shape, layerwise, seed=0, max_fraction=0.02):
    prog = qb.lower(model)
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 2
    diffs = layerwise(model, prog, {"x": x})
    assert diffs, "no quantized layer was compared"
    worst = max(int(d.max()) for d in diffs.values())
    fraction = sum(int((d > 0).sum()) for d in diffs.values()) / sum(d.size for d in diffs.values())
    assert worst <= 1, {k: int(v.max()) for k, v in diffs.items()}
    assert fraction <= max_fraction, fraction
    return prog


def _conv(g, cin, cout, k=3, group=1, per_channel=True, relu=None, **attrs):
    w = g.weight((cout, cin // group, *k) if isinstance(k, tuple) else (cout, cin // group, k, k),
                 per_channel=per_channel)  # fmt: skip
    b = g.bias(cout, 0.05 * 0.02)
    y = g.node("Conv", [g.x, w, b], group=group, **attrs)
    if relu == "relu":
        y = g.node("Relu", [y])
    elif relu == "relu6":
        y = g.node("Clip", [y, g.const(np.float32(0)), g.const(np.float32(6))])
    return g.quant(y, 0.08, 0 if relu else 128)


CASES = {
    "conv_relu_stride2": ((1, 4, 9, 9), lambda g: _conv(g, 4, 6, relu="relu", strides=[2, 2],
                                                          pads=[1, 1, 1, 1])),
    "conv_grouped_dilated": ((2, 4, 10, 10), lambda g: _conv(g, 4, 6, group=2, dilations=[2, 2],
                                                             pads=[2, 1, 2, 1])),
    "conv_depthwise_relu6": ((1, 6, 8, 8), lambda g: _conv(g, 6, 6, group=6, relu="relu6",
                                                           pads=[1, 1, 1, 1])),
    "conv_1d": ((2, 3, 16), lambda g: _conv(g, 3, 5, k=(3,), pads=[1, 1], strides=[2])),
    "conv_transpose": ((1, 4, 5, 5), lambda g: g.quant(g.node(
        "ConvTranspose", [g.x, g.weight((4, 3, 3, 3), axis=1), g.bias(3, 0.001)], strides=[2, 2],
        pads=[1, 1, 0, 0], output_padding=[1, 1]), 0.1, 120)),
    "conv_transpose_grouped": ((1, 4, 4, 4), lambda g: g.quant(g.node(
        "ConvTranspose", [g.x, g.weight((4, 2, 2, 2), per_channel=False)], strides=[2, 2],
        group=2), 0.1, 120)),
    "gemm_transB": ((3, 20), lambda g: g.quant(g.node(
        "Gemm", [g.x, g.weight((7, 20)), g.bias(7, 0.001)], transB=1), 0.1, 128)),
    "matmul_dq_transpose": ((2, 3, 16), lambda g: g.quant(g.node(
        "MatMul", [g.x, g.node("Transpose", [g.weight((5, 16), per_channel=False)],
                               perm=[1, 0])]), 0.1, 128)),
    "matmul_activations": ((2, 4, 8), lambda g: g.quant(g.node(
        "MatMul", [g.x, g.quant(g.node("Transpose", [g.x], perm=[0, 2, 1]), 0.05, 3)]), 0.2, 128)),
    "add_scales": ((2, 3, 5, 5), lambda g: g.quant(g.node(
        "Add", [g.x, g.quant(g.node("Relu", [g.x]), 0.013, 0)]), 0.07, 100)),
    "sub_scales": ((2, 3, 5, 5), lambda g: g.quant(g.node(
        "Sub", [g.x, g.quant(g.node("Sigmoid", [g.x]), 0.004, 0)]), 0.06, 140)),
    "mul_activations": ((2, 3, 5, 5), lambda g: g.quant(g.node(
        "Mul", [g.x, g.quant(g.node("Tanh", [g.x]), 0.008, 128)]), 0.03, 128)),
    "concat_scales": ((1, 3, 4, 4), lambda g: g.quant(g.node(
        "Concat", [g.x, g.quant(g.node("Relu", [g.x]), 0.031, 0)], axis=1), 0.04, 10)),
    "avgpool_pads_excluded": ((2, 3, 15, 15), lambda g: g.quant(g.node(
        "AveragePool", [g.x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), 0.03, 3)),
    "avgpool_pads_included": ((1, 3, 7, 7), lambda g: g.quant(g.node(
        "AveragePool", [g.x], kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1),
        0.03, 3)),
    "global_avgpool": ((2, 3, 5, 6), lambda g: g.quant(g.node("GlobalAveragePool", [g.x]),
                                                       0.01, 3)),
    "reduce_mean": ((2, 3, 5, 6), lambda g: g.quant(g.node(
        "ReduceMean", [g.x, g.const(np.array([2, 3]))], keepdims=0), 0.01, 3)),
    "maxpool": ((1, 3, 8, 8), lambda g: g.quant(g.node(
        "MaxPool", [g.x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), 0.05, 3)),
    "movement": ((2, 3, 4, 6), lambda g: g.quant(g.node("Flatten", [g.node("Slice", [
        g.node("Unsqueeze", [g.node("Transpose", [g.node("Reshape", [g.x, g.const(
            np.array([2, 3, 24]))]), ], perm=[0, 2, 1]), g.const(np.array([1]))]),
        g.const(np.array([0, 0, 1])), g.const(np.array([1, 99, 3])), g.const(np.array([0, 2, 3])),
        g.const(np.array([1, 3, 1]))])], axis=2), 0.05, 3)),
    "split_chunks": ((2, 3, 5, 6), lambda g: g.quant(g.node("Concat", g.node_outputs(
        "Split", [g.x], 2, axis=2, num_outputs=2)[::-1], axis=2), 0.05, 3)),
    "split_sizes": ((2, 3, 5, 6), lambda g: g.quant(g.node("Concat", g.node_outputs(
        "Split", [g.x, g.const(np.array([1, 4, 1]))], 3, axis=3)[::-1], axis=3), 0.05, 3)),
    "resize_nearest": ((1, 2, 3, 4), lambda g: g.quant(g.node(
        "Resize", [g.x, "", g.const(np.array([1, 1, 2.0, 1.5], np.float32))], mode="nearest",
        coordinate_transformation_mode="asymmetric", nearest_mode="floor"), 0.05, 3)),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_agrees_with_ort(case, qdq_graph, layerwise):
    shape, build = CASES[case]
    g = qdq_graph(shape)
    out = build(g)
    _check(g.model(out), shape, layerwise)


UNARY = {
    "Sigmoid": lambda g: g.node("Sigmoid", [g.x]),
    "Tanh": lambda g: g.node("Tanh", [g.x]),
    "Exp": lambda g: g.node("Exp", [g.x]),
    "HardSigmoid": lambda g: g.node("HardSigmoid", [g.x], alpha=0.25, beta=0.4),
    "HardSwish": lambda g: g.node("HardSwish", [g.x]),
    "Gelu": lambda g: g.node("Gelu", [g.x]),
    "Gelu_tanh": lambda g: g.node("Gelu", [g.x], approximate="tanh"),
    "SiLU": lambda g: g.node("Mul", [g.x, g.node("Sigmoid", [g.x])]),
    "HardSwish_written_out": lambda g: g.node("Div", [g.node("Mul", [g.x, g.node("Clip", [
        g.node("Add", [g.x, g.const(np.float32(3))]), g.const(np.float32(0)),
        g.const(np.float32(6))])]), g.const(np.float32(6))]),
}  # fmt: skip


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_is_one_exact_table(op, qdq_graph, layerwise):
    g = qdq_graph((2, 3, 16, 16), scale=0.0312345, zero=128)
    model = g.model(g.quant(UNARY[op](g), 0.0212345 if op != "Exp" else 0.212345, 20))
    prog = _check(model, (2, 3, 16, 16), layerwise, max_fraction=0.01)
    assert prog.op_counts() == {"lut": 1}
    # every code of the input dtype is in the table, and the table is the float64 function
    table = prog.steps[0].attrs["table"]
    assert table.shape == (256,)


def test_power_of_two_scales_are_pure_shifts(qdq_graph, layerwise):
    g = qdq_graph((1, 4, 6, 6), scale=2.0**-4, zero=0, dtype=np.int8)
    w = g.weight((5, 4, 3, 3), scale=2.0**-6, per_channel=False)
    y = g.quant(g.node("Conv", [g.x, w], pads=[1, 1, 1, 1]), 2.0**-3, 0, np.int8)
    z = g.quant(g.node("Add", [y, g.quant(g.node("Relu", [y]), 2.0**-2, 0, np.int8)]), 2.0**-2, 0,
                np.int8)  # fmt: skip
    prog = _check(g.model(z), (1, 4, 6, 6), layerwise)
    conv = next(s for s in prog.steps if s.op == "conv")
    assert (conv.attrs["multiplier"] == 1).all() and (conv.attrs["shift"] == 7).all()
    add = next(s for s in prog.steps if s.op == "rescale_sum")
    assert all(m & (m - 1) == 0 for m in add.attrs["multipliers"])  # powers of two: shifts
    assert all(f["power_of_two"] for f in prog.formats())


def test_transpose_of_a_scalar_stays_a_scalar(qdq_graph):
    """Regression: the Transpose kernel made its result contiguous with ``np.ascontiguousarray``,
    which turns a 0-d array 1-d, so a scalar (``Squeeze`` of a one-element tensor) transposed
    came out of the program as shape ``(1,)`` (and ``tensor_shapes``, which sizes the C and ONNX
    emitters' buffers, said so) where ONNX Runtime gives ``()``."""
    import onnxruntime as ort

    g = qdq_graph((1,), scale=0.05, zero=3)
    scalar = g.node("Squeeze", [g.x])
    out = g.quant(g.node("Add", [g.node("Transpose", [scalar]), scalar]), 0.05, 3)
    model = g.model(out)
    prog = qb.lower(model)
    x = np.array([0.77], np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    want = ref.run(None, {"x": x})[0]
    got = prog.run({"x": x})[out]
    assert want.shape == got.shape == ()
    # codes: x -> round(0.77 / 0.05) + 3 = 18 (0.75); 0.75 + 0.75 = 1.5 -> 30 + 3 = 33 exactly
    assert float(got) == float(want) == np.float32(0.05) * 30
    shapes = prog.tensor_shapes()
    assert shapes.pop(prog.inputs[0].tensor.name) == (1,)
    assert set(shapes.values()) == {()}, shapes
