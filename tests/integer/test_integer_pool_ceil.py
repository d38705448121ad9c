"""Pools with ``ceil_mode=1`` (EfficientNet's and torchvision's ``ceil_mode=True`` pools, HF
EfficientNet's final AveragePool): lowered as ``ceil_mode=0`` with extra end padding that no
sum, max or count sees (``lowering._pool._ceil_pads``); against ONNX Runtime on the same file."""

from __future__ import annotations

import numpy as np
import pytest

import quantbridge as qb


@pytest.mark.parametrize(
    ("op", "pads", "include_pad", "shape"),
    [
        ("AveragePool", [0, 0, 0, 0], 0, (1, 2, 6, 7)),
        ("AveragePool", [1, 1, 1, 1], 0, (1, 2, 6, 7)),
        ("AveragePool", [1, 0, 1, 0], 1, (1, 2, 6, 7)),
        ("AveragePool", [0, 0, 0, 0], 0, (1, 2, 5, 5)),  # the last window would start in padding
        ("MaxPool", [1, 1, 1, 1], 0, (1, 2, 6, 7)),
    ],
)
def test_ceil_mode_pools_match_ort(op, pads, include_pad, shape, qdq_graph, layerwise,
                                   three_emitters, node_by_node, tmp_path):  # fmt: skip
    """Before: "only 2-D pools with explicit pads and ceil_mode=0 are lowered" (2026-12-02).
    The output shape is ORT's; the averages divide by the cells ORT counts (the partial last
    windows: fewer), so each output is the same real mean rounded once: within 1 LSB (ORT's
    float32 mean can round a tie the other way); the max is exact (0 LSB)."""
    g = qdq_graph(shape, scale=0.05, zero=128)
    extra = {"count_include_pad": include_pad} if op == "AveragePool" else {}
    y = g.node(op, [g.x], kernel_shape=[3, 3], strides=[2, 2], pads=pads, ceil_mode=1, **extra)
    model = g.model(g.quant(y, 0.03, 128))
    feeds = {"x": np.random.default_rng(3).normal(0, 2, shape).astype(np.float32)}
    prog = qb.lower(model)
    got = prog.run(feeds)[model.graph.output[0].name]
    assert got.shape == node_by_node(model).run(None, feeds)[0].shape
    (d,) = layerwise(model, prog, feeds).values()
    assert int(d.max()) <= (1 if op == "AveragePool" else 0)
    three_emitters(prog, feeds, tmp_path)
