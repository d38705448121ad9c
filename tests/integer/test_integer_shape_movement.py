"""``qb.lower`` on the shape arithmetic and data movement of real models (regression sweep,
2026-12-02): a ViT / CLIP / DINOv2 stem (``Shape`` of the input -> ``Concat`` -> ``Expand`` of
the class token, then the float position embedding added), PixelShuffle (``DepthToSpace``),
``SpaceToDepth``, ``Tile`` (``torch.repeat``) and ``Expand``. Before the fix every one was
refused ("no integer lowering: Expand, Shape" on every HF ViT even with ``input_shapes``;
"operands must be quantized tensors" at the position-embedding Add).

Reference: ONNX Runtime (optimizations off) on the same file, compared at every activation
QuantizeLinear from the program's own input codes (``layerwise``), and at the output.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import quantbridge as qb


def _vit_stem(qdq_graph, batch="N"):
    """tokens (N, 4, 8) on a uint8 grid; class token (1, 1, 8) expanded to (N, 1, 8) by a shape
    computed from the input; concatenated; + a float position embedding (1, 5, 8)."""
    g = qdq_graph((2, 4, 8), scale=0.05, zero=128)
    g.inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4, 8])]
    batch_dim = g.node("Shape", ["x"], start=0, end=1)
    target = g.node("Concat", [batch_dim, g.const(np.array([1, 8], np.int64))], axis=0)
    cls = g.node("Expand", [g.const(g.rng.normal(0, 1, (1, 1, 8)).astype(np.float32)), target])
    cls = g.quant(cls, 0.05, 128)
    tokens = g.quant(g.node("Concat", [cls, g.x], axis=1), 0.05, 128)
    pos = g.const(g.rng.normal(0, 0.7, (1, 5, 8)).astype(np.float32))
    return g, g.quant(g.node("Add", [tokens, pos]), 0.07, 120)


def test_vit_stem_lowers_and_matches_ort(qdq_graph):
    """The position embedding goes on an int32 grid 256 times finer than the tokens' (error
    <= 0.05 / 512 = 1e-4, 0.0014 of the output step 0.07): a code moves only at a float tie,
    so at most 1 LSB against ONNX Runtime's float Add (measured: all codes exact). The class
    token is a constant: Shape, Concat, Expand and its QuantizeLinear fold at lowering."""
    g, y = _vit_stem(qdq_graph)
    model = g.model(y)
    x = np.random.default_rng(1).normal(0, 2, (2, 4, 8)).astype(np.float32)
    prog = qb.lower(model, input_shapes={"x": (2, 4, 8)})
    assert {s.op for s in prog.steps} == {"concat", "rescale_sum"}
    got = next(iter(prog.run({"x": x}).values()))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ref = sess.run(None, {"x": x})[0]
    lsb = np.abs(got.astype(np.float64) - ref) / 0.07
    assert got.shape == (2, 5, 8) and lsb.max() <= 1.001 and np.mean(lsb < 1e-3) > 0.99


def test_shape_of_a_dynamic_input_names_input_shapes(qdq_graph):
    g, y = _vit_stem(qdq_graph)
    with pytest.raises(qb.LoweringError, match=r"Shape .*not static.*input_shapes"):
        qb.lower(g.model(y))


def test_pixel_shuffle_tile_expand_match_ort(qdq_graph, layerwise, three_emitters, tmp_path):
    """Movement on codes is exact (0 LSB) against ONNX Runtime, and the integer-only ONNX and C
    forms (index maps computed by the numpy kernels on ``arange``) compute the same codes."""
    g = qdq_graph((2, 8, 3, 4), scale=0.05, zero=128)
    y = g.quant(g.node("DepthToSpace", [g.x], blocksize=2, mode="CRD"), 0.05, 128)  # (2, 2, 6, 8)
    y = g.quant(g.node("DepthToSpace", [g.node("SpaceToDepth", [y], blocksize=2)],
                       blocksize=2, mode="DCR"), 0.05, 128)  # fmt: skip
    y = g.quant(g.node("Tile", [y, g.const(np.array([1, 2, 1, 1], np.int64))]), 0.05, 128)
    row = g.node("Slice", [y, *(g.const(np.array([v], np.int64)) for v in (0, 1, 2))])
    y = g.quant(g.node("Expand", [row, g.const(np.array([2, 4, 3, 8], np.int64))]), 0.05, 128)
    model = g.model(y)
    x = np.random.default_rng(2).normal(0, 2, (2, 8, 3, 4)).astype(np.float32)
    prog = qb.lower(model)
    diffs = layerwise(model, prog, {"x": x})
    assert len(diffs) == 4 and all(int(d.max()) == 0 for d in diffs.values())
    assert next(iter(prog.run({"x": x}).values())).shape == (2, 4, 3, 8)
    three_emitters(prog, {"x": x}, tmp_path)
