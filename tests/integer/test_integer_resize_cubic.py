"""Cubic (bicubic) Resize lowered to one ``resize_cubic`` step (``lowering._resize``): four
fixed-point taps per resized axis, one rounding at the end; against ONNX Runtime running the
same QDQ file node by node, and the three emitters."""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

import quantbridge as qb

# as torch 2's exporter writes F.interpolate(mode="bicubic"): half_pixel (align_corners=False;
# the TorchScript exporter wrote pytorch_half_pixel) or align_corners, cubic_coeff_a -0.75;
# ONNX's default coefficient -0.5 and the other modes too
CASES = [
    ("half_pixel", -0.75, "scales"),
    ("align_corners", -0.75, "scales"),
    ("pytorch_half_pixel", -0.75, "sizes"),
    ("align_corners", -0.75, "sizes"),
    ("half_pixel", -0.5, "scales"),
    ("asymmetric", -0.5, "sizes"),
    ("half_pixel", -0.5, "sizes"),
]


def _cubic_model(qdq_graph, mode: str, coeff: float, by: str, exclude: int = 0):
    g = qdq_graph((1, 3, 5, 7), scale=0.05, zero=128)
    if by == "scales":
        target = ["", g.const(np.array([1, 1, 2, 2], np.float32))]
    else:  # up on one axis, down on the other
        target = ["", "", g.const(np.array([1, 3, 9, 5], np.int64))]
    r = g.node("Resize", [g.x, *target], mode="cubic", coordinate_transformation_mode=mode,
               cubic_coeff_a=coeff, exclude_outside=exclude)  # fmt: skip
    return g.model(g.quant(r, 0.06, 120))


@pytest.mark.parametrize(("mode", "coeff", "by"), CASES)
def test_cubic_resize_matches_ort(mode, coeff, by, qdq_graph, layerwise):
    """Weights rounded to ``2**-F`` (``F`` = 11 here; sum kept at exactly ``2**F``), so the
    program's sum is off from the exact one by at most ``4 * 2**-12`` of the input range per
    axis (about ``2**-9.4`` of it, ~0.15 output steps at worst, typically far less since the
    rounding errors of the taps have both signs), then one rounding. ORT sums in float32. So
    only values near a half code can differ, by 1. With 2x / align_corners fractions (halves,
    quarters) the weights are exact and the exact result often lands on a half code of the
    0.06 grid, which ORT's float32 rounds either way: max 1 LSB, >= 95% exact (measured over
    3 seeds: 97.8% to 100% exact per case, printed)."""
    model = _cubic_model(qdq_graph, mode, coeff, by)
    prog = qb.lower(model)
    assert set(prog.op_counts()) == {"resize_cubic"}
    every = []
    for seed in range(3):
        feeds = {"x": np.random.default_rng(seed).normal(0, 2, (1, 3, 5, 7)).astype(np.float32)}
        every += [d.reshape(-1) for d in layerwise(model, prog, feeds).values()]
    every = np.concatenate(every)
    print(f"\n{mode} a={coeff} {by}: max {every.max()} LSB, {(every == 0).mean():.2%} exact")
    assert every.max() <= 1 and (every == 0).mean() >= 0.95


def test_cubic_exclude_outside_matches_ort(qdq_graph, layerwise):
    """``exclude_outside=1``: taps outside the axis get weight 0, the rest renormalized."""
    model = _cubic_model(qdq_graph, "half_pixel", -0.5, "scales", exclude=1)
    prog = qb.lower(model)
    feeds = {"x": np.random.default_rng(5).normal(0, 2, (1, 3, 5, 7)).astype(np.float32)}
    diffs = layerwise(model, prog, feeds)
    assert max(int(d.max()) for d in diffs.values()) <= 1


@pytest.mark.parametrize(
    ("mode", "by"), [("pytorch_half_pixel", "scales"), ("align_corners", "sizes")]
)
def test_cubic_three_emitters(mode, by, qdq_graph, three_emitters, tmp_path):
    prog = qb.lower(_cubic_model(qdq_graph, mode, -0.75, by))
    x = np.random.default_rng(9).normal(0, 3, (1, 3, 5, 7)).astype(np.float32)  # saturating too
    three_emitters(prog, {"x": x}, tmp_path)


class _Bicubic(torch.nn.Module):
    """conv -> F.interpolate(bicubic, x2) twice (align_corners False and True) -> conv."""

    def __init__(self):
        super().__init__()
        self.conv, self.out = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.conv(x)
        up = [
            F.interpolate(y, scale_factor=2, mode="bicubic", align_corners=a) for a in (False, True)
        ]
        return self.out(torch.cat(up, dim=1))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("QB_SKIP_SLOW") == "1", reason="QB_SKIP_SLOW=1")
def test_torch_bicubic_export_lowers_and_matches_ort(tmp_path, layerwise, three_emitters):
    """qb.quantize + qb.export of torch's bicubic upsampling: the exporter writes mode=cubic,
    cubic_coeff_a=-0.75 with half_pixel / align_corners (both asserted), lowered with a static
    shape; every quantized tensor within 1 LSB of ORT node by node (as above), >= 99% exact."""
    torch.manual_seed(0)
    shape = (2, 4, 6, 6)
    qmodel = qb.quantize(_Bicubic().eval(), [torch.randn(*shape) for _ in range(4)],
                         recipe="int8", progress=False)  # fmt: skip
    with warnings.catch_warnings():  # without VNNI: the engine-saturation warning
        warnings.simplefilter("ignore")
        qb.export(qmodel, tmp_path / "bicubic.onnx", example_inputs=torch.zeros(*shape))
    model = onnx.load(tmp_path / "bicubic.onnx")
    resizes = [n for n in model.graph.node if n.op_type == "Resize"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in resizes]
    assert sorted(a["coordinate_transformation_mode"] for a in attrs) == [
        b"align_corners", b"half_pixel"]  # fmt: skip
    assert all(a["mode"] == b"cubic" and a["cubic_coeff_a"] == -0.75 for a in attrs)
    prog = qb.lower(model, input_shapes={"x": shape})
    assert prog.op_counts()["resize_cubic"] == 2
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    every = np.concatenate([d.reshape(-1) for d in layerwise(model, prog, {"x": x}).values()])
    print(f"\ntorch bicubic: max {every.max()} LSB, {(every == 0).mean():.2%} exact")
    assert every.max() <= 1 and (every == 0).mean() >= 0.99
    three_emitters(prog, {"x": x}, tmp_path)
