"""Linear (bilinear) Resize lowered to one ``resize_linear`` step (``lowering._resize``):
against ONNX Runtime on the same file, and the three emitters."""

from __future__ import annotations

import numpy as np
import pytest

import quantbridge as qb

MODES = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"]


@pytest.mark.parametrize("by", ["scales", "sizes"])
@pytest.mark.parametrize("mode", MODES)
def test_linear_resize_matches_ort(mode, by, qdq_graph, layerwise, three_emitters, tmp_path):
    """SegFormer / MobileViT / FPN decoders upsample bilinearly; before: "mode=linear ...; only
    nearest resizing ... moves codes exactly" (2026-12-02). 2x scales (weights in quarters,
    exact in the program) and sizes 5x7 -> 8x17 (weights in 8ths / 16ths and thirds rounded to
    2**-11). The output grid is 1.25 input steps, so exact results land on half codes often:
    ORT's float32 sums round those ties either way, hence within 1 LSB (measured: 0.5% to 6%
    of codes off by one, none by more)."""
    g = qdq_graph((1, 3, 5, 7), scale=0.05, zero=128)
    if by == "scales":
        target = ["", g.const(np.array([1, 1, 2, 2], np.float32))]
    else:
        target = ["", "", g.const(np.array([1, 3, 8, 17], np.int64))]
    r = g.node("Resize", [g.x, *target], mode="linear", coordinate_transformation_mode=mode)
    model = g.model(g.quant(r, 0.04, 120))
    feeds = {"x": np.random.default_rng(1).normal(0, 2, (1, 3, 5, 7)).astype(np.float32)}
    prog = qb.lower(model)
    assert set(prog.op_counts()) == {"resize_linear"}
    diffs = layerwise(model, prog, feeds)
    assert len(diffs) == 1 and max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)


def test_refused_resize_names_the_node_and_the_fix(qdq_graph):
    g = qdq_graph((1, 2, 4, 4), scale=0.05, zero=128)
    scales = g.const(np.array([1, 1, 2, 2], np.float32))
    r = g.node("Resize", [g.x, "", scales], mode="cubic", antialias=1)  # (cubic lowers)
    with pytest.raises(qb.LoweringError, match=r"Resize 'resize_\d+': mode=cubic.*antialias"):
        qb.lower(g.model(g.quant(r, 0.05, 128)))


def test_linear_resize_of_a_layer_norm(qdq_graph, layerwise, three_emitters, tmp_path):
    """MobileViT folds a LayerNorm's output back to an image and resizes it with no
    QuantizeLinear between; before: "a linear Resize is lowered on a quantized 8-bit tensor"
    (HF MobileViT, 2026-12-02). The norm goes on int16 codes of bound / 32767 (bound = 1.5
    sqrt(4) + 0.6 here: 1e-4 per code against a 0.03 output step), F = 7 weight bits (2x:
    quarters, exact): within 1 LSB of ORT."""
    g = qdq_graph((1, 3, 4, 4), scale=0.05, zero=128)
    gamma = g.const(g.rng.uniform(0.5, 1.5, 4).astype(np.float32))
    beta = g.const(g.rng.normal(0, 0.2, 4).astype(np.float32))
    norm = g.node("LayerNormalization", [g.x, gamma, beta])
    scales = g.const(np.array([1, 1, 2, 2], np.float32))
    r = g.node("Resize", [norm, "", scales], mode="linear")
    model = g.model(g.quant(r, 0.03, 128))
    feeds = {"x": np.random.default_rng(1).normal(0, 2, (1, 3, 4, 4)).astype(np.float32)}
    prog = qb.lower(model)
    assert {"layernorm", "resize_linear"} == set(prog.op_counts())
    diffs = layerwise(model, prog, feeds)
    assert len(diffs) == 1 and max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)
