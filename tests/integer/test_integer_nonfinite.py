"""IsNaN / IsInf (``lowering._nonfinite``): a constant false on codes and integer tensors, and
the NaN rows of a softmax masked with -inf, as torch's TorchScript exporter writes
``scaled_dot_product_attention`` with a boolean mask (HF BERT, ``dynamo=False``)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import quantbridge as qb

SHAPE = (2, 2, 5, 5)  # scores (batch, heads, queries, keys)


def _sdpa_bool_mask(qdq_graph):
    """torch.onnx's symbolic (opset 14) for a bool ``attn_mask``: ``Where(mask, 0, -inf)`` added
    to the scores, Softmax, then ``Where(IsNaN(p), 0, p)``; plus ``Where(IsInf(x), 0, x)`` of a
    quantized value and ``IsNaN`` of the mask made float, And-ed into it (both constant false)."""
    g = qdq_graph(SHAPE, scale=0.1, zero=128)
    g.inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT64, [2, 5]))
    axes = g.const(np.array([1, 2], np.int64))
    unsqueezed = g.node("Unsqueeze", ["mask", axes])
    keep = g.node("Cast", [unsqueezed], to=TensorProto.BOOL)
    as_float = g.node("Cast", [unsqueezed], to=TensorProto.FLOAT)
    keep = g.node("And", [keep, g.node("Not", [g.node("IsNaN", [as_float])])])
    zero, neg_inf = g.const(np.float32(0)), g.const(np.array([-np.inf], np.float32))
    additive = g.node("Where", [keep, zero, neg_inf])
    p = g.node("Softmax", [g.node("Add", [g.x, additive])], axis=-1)
    probs = g.quant(g.node("Where", [g.node("IsNaN", [p]), zero, p]), 1 / 255, 0)
    finite = g.quant(g.node("Where", [g.node("IsInf", [g.x]), zero, g.x]), 0.1, 128)
    return g.model(probs, finite)


def test_nan_rows_of_a_bool_masked_softmax(qdq_graph, layerwise, three_emitters, node_by_node,
                                           tmp_path):  # fmt: skip
    """Before: "cannot lower 2 nodes with no integer lowering: IsNaN" (HF BERT exported with
    dynamo=False, then `quantbridge quantize`, 2026-12-02). ORT's fully masked row is NaN, then
    0; the program writes code 0 there (exact), and the kept rows' probabilities are within 1
    LSB of ORT (the int16 probabilities round once more than ORT's float ones). IsInf of a
    quantized value and IsNaN of a mask are constant false: the `finite` output is the input's
    codes exactly (0 LSB)."""
    model = _sdpa_bool_mask(qdq_graph)
    rng = np.random.default_rng(3)
    mask = np.ones((2, 5), np.int64)
    mask[0, 3:] = 0
    mask[1] = 0  # every key masked: NaN in ORT's softmax, 0 after its Where
    feeds = {"x": rng.normal(0, 3, SHAPE).astype(np.float32), "mask": mask}
    prog = qb.lower(model)
    assert {"softmax", "reduce_max", "compare", "where"} <= set(prog.op_counts())
    diffs = layerwise(model, prog, feeds)
    assert len(diffs) == 2 and max(int(d.max()) for d in diffs.values()) <= 1
    ref = node_by_node(model).run(None, feeds)
    got = list(prog.run(feeds).values())
    assert np.all(ref[0][1] == 0) and np.all(got[0][1] == 0)  # the fully masked batch row
    assert np.max(np.abs(got[0] - ref[0])) <= 1 / 255 + 1e-6
    np.testing.assert_array_equal(got[1], ref[1])
    three_emitters(prog, feeds, tmp_path)


def test_is_nan_of_a_float_result_is_refused(qdq_graph):
    g = qdq_graph((2, 4))
    total = g.node("Add", [g.x, g.x])  # a float sum with no QuantizeLinear yet
    model = g.model(g.quant(g.node("Where", [g.node("IsNaN", [total]), g.x, total]), 0.1, 0))
    with pytest.raises(qb.LoweringError, match=r"IsNaN .*lowered only on quantized"):
        qb.lower(model)
