"""Einsum as a matrix product: the same integer kernel (bit-exact codes) as the MatMul it
spells out, within 1 LSB of ONNX Runtime, the three emitters bit-exact with each other."""

from __future__ import annotations

import numpy as np
import pytest

import quantbridge as qb

SHAPE = (2, 3, 4, 8)


def _graph(qdq_graph, equation=None):
    """x @ y^T (scores) and x @ W^T (a weight [out, in]), as Einsum or as Transpose + MatMul."""
    g = qdq_graph(SHAPE, scale=0.05, zero=128)
    y = g.quant(g.node("Relu", [g.x]), 0.04, 0)
    w = g.weight((5, 8), per_channel=False)
    if equation is None:
        scores = g.node("MatMul", [g.x, g.node("Transpose", [y], perm=[0, 1, 3, 2])])
        proj = g.node("MatMul", [g.x, g.node("Transpose", [w], perm=[1, 0])])
    else:
        scores = g.node("Einsum", [g.x, y], equation=equation)
        proj = g.node("Einsum", [g.x, w], equation="...ij,kj->...ik")
    return g.model(g.quant(scores, 0.5, 128), g.quant(proj, 0.1, 128))


@pytest.mark.parametrize("equation", ["bhid,bhjd->bhij", "...id,...jd->...ij"])
def test_einsum_is_the_matmul_kernel(qdq_graph, layerwise, three_emitters, tmp_path, equation):
    x = np.random.default_rng(5).normal(0, 2, SHAPE).astype(np.float32)
    model = _graph(qdq_graph, equation)
    prog = qb.lower(model)
    reference = qb.lower(_graph(qdq_graph)).run({"x": x}, integer=True)
    for got, expected in zip(prog.run({"x": x}, integer=True).values(), reference.values(),
                             strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, expected)
    # 1 LSB: the requantization rounds the exact int32 accumulator, ORT its float product once
    assert max(int(d.max()) for d in layerwise(model, prog, {"x": x}).values()) <= 1
    three_emitters(prog, {"x": x}, tmp_path)


def test_other_contractions_name_the_fix(qdq_graph):
    g = qdq_graph((4, 4))
    y = g.node("Einsum", [g.x, g.x], equation="ij,ij->i")  # a row-wise dot product
    with pytest.raises(qb.LoweringError, match=r"not a matrix product.*Transpose \+ MatMul"):
        qb.lower(g.model(g.quant(y, 0.1, 128)))
