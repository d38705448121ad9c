"""``qb.lower`` of a file whose reshape targets are computed from the input's shape, as torch
exports ``x.reshape(B, T, H, C // H)``: ``Shape -> Gather -> Div -> Unsqueeze -> Concat ->
Reshape``. ONNX's shape inference does not propagate values through ``Div``, and ONNX Runtime's
quantizer stores symbolic ``value_info`` (``unk__4``) that inference keeps: the head size, the
reduction length of the attention scores ``q @ k^T``, stayed unknown, and the lowering refused
every such file ("MatMul ...: the reduction length of ... is unknown, so its accumulator cannot be
bounded"; ORT's QDQ files of a MiniLM-style model, import sweep of 2026-12-03), even with
``input_shapes`` given."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import quantbridge as qb

HEADS, C = 4, 16


def _model(qdq_graph, symbolic_value_info: bool) -> onnx.ModelProto:
    g = qdq_graph(["b", "t", C], scale=0.05, zero=128)
    shape = g.node("Shape", [g.x])
    dims = [g.node("Gather", [shape, g.const(np.int64(i))], axis=0) for i in range(3)]
    head = g.node("Div", [dims[2], g.const(np.int64(HEADS))])  # C // H, as torch exports it
    parts = [g.node("Unsqueeze", [d, g.const(np.array([0], np.int64))]) for d in
             (dims[0], dims[1])] + [g.const(np.array([HEADS], np.int64)),
             g.node("Unsqueeze", [head, g.const(np.array([0], np.int64))])]  # fmt: skip
    target = g.node("Concat", parts, axis=0)
    heads = g.quant(g.node("Reshape", [g.x, target]), 0.05, 128)
    q = g.node("Transpose", [heads], perm=[0, 2, 1, 3])
    kt = g.node("Transpose", [heads], perm=[0, 2, 3, 1])
    scores = g.quant(g.node("MatMul", [q, kt]), 0.2, 128)
    model = g.model(scores)
    if symbolic_value_info:  # as ONNX Runtime's quantizer leaves them
        for k, name in enumerate((heads, q, kt)):
            dims = [f"unk__{4 * k + i}" for i in range(4)]
            model.graph.value_info.append(
                helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)
            )
    return model


@pytest.mark.parametrize("symbolic_value_info", [False, True])
def test_head_size_from_shape_arithmetic_lowers(qdq_graph, layerwise, symbolic_value_info):
    """The scores MatMul lowers, and each requantized tensor is within 1 LSB of ONNX Runtime fed
    the program's own codes (a float32 tie in ORT's requantization moves one code)."""
    model = _model(qdq_graph, symbolic_value_info)
    x = np.random.default_rng(0).standard_normal((2, 5, C)).astype(np.float32)
    prog = qb.lower(model, input_shapes={"x": x.shape})
    diffs = layerwise(model, prog, {"x": x})
    assert diffs and max(int(d.max()) for d in diffs.values()) <= 1
