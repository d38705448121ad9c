"""Bad input to ``lower``: float models, ops with no lowering (all listed at once), a Q whose DQ
partner differs, accumulators that could overflow (refused unless a wider one is allowed)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import quantbridge as qb


def test_float_model_says_quantize_first():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    with pytest.raises(qb.LoweringError, match="float model; quantize it first"):
        qb.lower(helper.make_model(graph))


def test_every_op_without_lowering_is_listed(qdq_graph):
    g = qdq_graph((1, 4, 8))
    a = g.node("Hardmax", [g.x])  # (Softmax and LayerNormalization lower since issue 10)
    b = g.node("Shrink", [a])  # (LpNormalization lowers since the division kernel)
    c = g.node("Hardmax", [b])
    with pytest.raises(qb.LoweringError) as err:
        qb.lower(g.model(g.quant(c, 0.1, 0)))
    message = str(err.value)
    assert "cannot lower 3 nodes" in message
    assert f"Hardmax (2: '{a}', '{c}')" in message and f"Shrink (1: '{b}')" in message


def test_mismatched_q_dq_names_the_node(qdq_graph):
    g = qdq_graph((1, 4))
    s, s2, z = g.const(np.float32(0.1)), g.const(np.float32(0.2)), g.const(np.uint8(0))
    q = g.node("QuantizeLinear", [g.node("Relu", [g.x]), s, z])
    dq = g.node("DequantizeLinear", [q, s2, z])
    with pytest.raises(qb.LoweringError, match=f"DequantizeLinear '{dq}': scale 0.2.*partner"):
        qb.lower(g.model(dq))


def test_unquantized_output_is_refused(qdq_graph):
    g = qdq_graph((1, 4))
    with pytest.raises(qb.LoweringError, match="not quantized"):
        qb.lower(g.model(g.node("Sigmoid", [g.x])), float_outputs="refuse")


def _wide_model(qdq_graph, k):
    """A MatMul whose K and saturated int8 weights can overflow int32: 255 * 127 * K."""
    g = qdq_graph((1, k), scale=0.01, zero=0)
    w = g.weight((k, 4), per_channel=False, low=127, high=128)  # every weight 127
    return g.model(g.quant(g.node("MatMul", [g.x, w]), 10000.0, 128))


def test_overflowing_accumulator_is_refused_and_named(qdq_graph):
    assert qb.lower(_wide_model(qdq_graph, 66000))  # 255 * 127 * 66000 < 2**31 - 1
    model = _wide_model(qdq_graph, 67000)  # 255 * 127 * 67000 = 2_169_795_000 > 2**31 - 1
    name = next(n.name for n in model.graph.node if n.op_type == "MatMul")
    with pytest.raises(qb.LoweringError, match=f"{name}: .accumulator. can reach 2169795000"):
        qb.lower(model)
    prog = qb.lower(model, accumulator_bits=64)
    x = np.full((1, 67000), 2.55, np.float32)  # every code 255: the sum reaches the bound
    y = prog.run({"x": x}, integer=True)
    out = prog.outputs[0]
    # the exact sum 2_169_795_000 (it needs more than int32) times 0.01 * 0.02 / 10000: 43.4
    scale = float(np.float32(0.01)) * float(np.float32(0.02)) / 10000.0
    expected = 128 + round(2_169_795_000 * scale)
    assert (y[out.name] == expected).all()


def test_accumulator_bits_must_be_32_or_64(qdq_graph):
    with pytest.raises(ValueError, match="32 or 64"):
        qb.lower(_wide_model(qdq_graph, 4), accumulator_bits=16)


def test_ops_real_models_hit_are_refused_with_what_to_do(qdq_graph):
    """LSTM, ScatterND (the last refusals of the model sweep with no kernel) are named with
    their node and the fix, all in one error."""
    g = qdq_graph((2, 3, 4))
    w = g.const(np.zeros((1, 16, 4), np.float32))
    r = g.const(np.zeros((1, 16, 4), np.float32))
    lstm = g.node("LSTM", [g.x, w, r], hidden_size=4)
    idx = g.const(np.zeros((1, 1), np.int64))
    scatter = g.node("ScatterND", [g.x, idx, g.const(np.zeros((1, 3, 4), np.float32))])
    with pytest.raises(qb.LoweringError) as err:
        qb.lower(g.model(g.quant(lstm, 0.1, 0), g.quant(scatter, 0.1, 0)))
    message = str(err.value)
    assert f"LSTM (1: '{lstm}')" in message and f"ScatterND (1: '{scatter}')" in message
    assert "LSTM: a recurrent layer" in message and "torch.cat of slices" in message
