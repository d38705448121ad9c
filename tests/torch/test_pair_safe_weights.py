"""``Recipe.pair_safe_weights`` (``torch.ptq._pair_bound``): the weight codes the model computes
with and exports keep every same-sign pair of the engines' reduction order (a conv weight
``(M, C/g, kh, kw)`` read as ``(M, kh, kw, C/g)``, re-derived here with numpy) within
``|q0| + |q1| <= 128``, so that ONNX Runtime's fused int8 kernels compute what its node-by-node
float evaluation does even on x86 without VNNI; depthwise convs keep their min-max grids;
``float_mode`` still runs the float weights."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.torch import float_mode


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),  # C/g = 3: pairs straddle taps
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16),  # depthwise: left alone
        nn.ReLU(),
        nn.Conv2d(16, 8, 1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 4),
    ).eval()
    with torch.no_grad():  # near-uniform weights: many same-sign pairs of two large codes
        for mod in m:
            if isinstance(mod, (nn.Conv2d, nn.Linear)):
                mod.weight.uniform_(-0.3, 0.3)
    return m


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.rand(4, 3, 6, 6, generator=g) * 4 for _ in range(2)]


def _codes(qmodel, name: str) -> np.ndarray:
    """The integer codes the QuantModel computes with: round(weight / scale) of ``name``."""
    q = qmodel.quantizers()[f"{name}.weight"]
    w = dict(qmodel.named_parameters())[f"{name}.weight"].detach().double()
    s = q.scale.double().reshape((-1,) + (1,) * (w.ndim - 1))
    return torch.round(w / s).numpy().astype(np.int64)


def _broken_pairs(codes: np.ndarray) -> int:
    """Same-sign pairs (2j, 2j + 1) of the engine rows with |q0| + |q1| > 128."""
    rows = codes.reshape(codes.shape[0], -1) if codes.ndim == 2 else codes
    if codes.ndim == 4:  # (M, C/g, kh, kw) -> (M, kh, kw, C/g): ONNX Runtime's QLinearConv order
        rows = codes.transpose(0, 2, 3, 1).reshape(codes.shape[0], -1)
    if rows.shape[1] % 2:
        rows = np.pad(rows, ((0, 0), (0, 1)))
    a, b = rows[:, 0::2], rows[:, 1::2]
    return int(((a * b > 0) & (np.abs(a) + np.abs(b) > 128)).sum())


@pytest.fixture(scope="module")
def quantized():
    m, data = _model(), _data()
    base = qb.quantize(m, data, recipe="int8", progress=False)
    r = dataclasses.replace(qb.Recipe.preset("int8"), pair_safe_weights=True)
    return m, data, base, qb.quantize(m, data, recipe=r, progress=False)


def test_codes_keep_every_pair_within_the_bound(quantized):
    m, _, base, safe = quantized
    for name in ("0", "4", "7"):
        assert _broken_pairs(_codes(base, name)) > 0  # the min-max grid breaks it here
        assert _broken_pairs(_codes(safe, name)) == 0
        assert np.abs(_codes(safe, name)).max() > 64  # still wider than the 7-bit grid
    # depthwise: the min-max grid and codes, unchanged
    np.testing.assert_array_equal(_codes(safe, "2"), _codes(base, "2"))
    torch.testing.assert_close(
        safe.quantizers()["2.weight"].scale, base.quantizers()["2.weight"].scale
    )


def test_float_mode_runs_the_float_weights(quantized):
    m, data, _, safe = quantized
    with torch.no_grad(), float_mode(safe):
        got = safe(data[0])
    torch.testing.assert_close(got, m(data[0]), rtol=0, atol=1e-5)  # the same float32 convs


def test_recipe_round_trip_and_exclusions():
    r = dataclasses.replace(qb.Recipe(), pair_safe_weights=True)
    assert qb.Recipe.from_dict(r.to_dict()) == r
    assert "pair_safe_weights" not in qb.Recipe().to_dict()  # written only when set
    with pytest.raises(ValueError, match="AdaRound and distillation"):
        dataclasses.replace(r, adaround=True)
    with pytest.raises(ValueError, match="True or False"):
        dataclasses.replace(r, pair_safe_weights="yes")


@pytest.mark.slow
def test_ort_fused_equals_node_by_node(quantized, tmp_path):
    """The property it exists for: ONNX Runtime's fused int8 kernels (int16 pair sums on x86
    without VNNI) give what its node-by-node float evaluation gives, on any CPU."""
    import onnxruntime as ort

    _, data, _, safe = quantized
    path = tmp_path / "safe.onnx"
    qb.export(safe, path, example_inputs=data[0])
    outs = []
    for level in (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    ):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        outs.append(s.run(None, {s.get_inputs()[0].name: data[1].numpy()})[0])
    # float outputs of an int8 last layer: the same int32 sums times one scale; float32 order
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_export_does_not_warn_of_saturation_for_bounded_pairs(quantized, monkeypatch):
    """On a CPU without VNNI the exporter warns of layers whose codes can saturate; the bounded
    codes cannot (except the depthwise conv's, which keep their min-max grid), the min-max codes
    can. ``u8s8_saturates`` forced True: the check must not depend on this machine."""
    from quantbridge.onnx.exporter import _export

    monkeypatch.setattr(_export, "u8s8_saturates", lambda: True)
    _, _, base, safe = quantized
    (warned_base,) = _export.saturation_warnings(base)
    assert "4 layer(s)" in warned_base
    (warned_safe,) = _export.saturation_warnings(safe)
    assert "1 layer(s) (first: '2.weight')" in warned_safe
