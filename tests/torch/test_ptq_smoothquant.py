"""SmoothQuant outlier migration (``torch.ptq._smoothquant``): the float function is unchanged,
the quantized error of linears fed by an outlier channel falls, and the three places ``1 / s``
goes (LayerNorm affine, previous linear, explicit division) survive save / load and export."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantbridge as qb


class OutlierBlock(nn.Module):
    """Linears reading one outlier input channel (x60 against the others, as BERT's LayerNorm
    outputs carry): ``attn`` and ``gate`` share a LayerNorm output that a float op reads too
    (Case 3, an explicit division), ``up`` reads a LayerNorm output alone (Case 1, into its
    affine), ``down`` reads ``up``'s output alone, whose outlier comes from ``up``'s weights
    (Case 2, into ``up``'s rows)."""

    def __init__(self, d: int = 64, ff: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.ln = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, ff)
        self.down = nn.Linear(ff, 8)
        with torch.no_grad():
            # each outlier channel's readers weigh it 1/60, as trained weights do: every
            # channel carries a similar share of the output
            self.ln.weight[3] = 60.0
            self.attn.weight[:, 3] /= 60.0
            self.gate.weight[:, 3] /= 60.0
            self.ln2.weight[5] = 60.0
            self.up.weight[:, 5] /= 60.0
            self.up.weight[7] *= 60.0
            self.up.bias[7] = 60.0
            self.down.weight[:, 7] /= 60.0

    def forward(self, x):
        h = self.ln(x)
        r = self.attn(h) + self.gate(h) + h.mean(-1, keepdim=True)
        return self.down(self.up(self.ln2(r)))


def _data(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 16, 64, generator=g) for _ in range(n)]


def _quantize(model, calib, smoothquant):
    recipe = dataclasses.replace(qb.Recipe.preset("native"), smoothquant=smoothquant)
    return qb.quantize(model, calib, recipe, progress=False)


def _sqnr_db(ref, out) -> float:
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


@pytest.fixture(scope="module")
def block():
    model = OutlierBlock().eval()
    return model, _quantize(model, _data(4, 1), "auto")


def test_cases_and_float_function_unchanged(block):
    model, q = block
    alphas = q.qb_capture["smoothquant_alphas"]
    assert all(alphas[name] is not None for name in alphas), alphas  # every group smoothed
    assert len(alphas) == 3  # the inputs of attn + gate, up, down
    assert q.qb_capture["smoothed"] == ["layer_norm"]  # only the shared LayerNorm output
    with torch.no_grad(), qb.float_mode(q):
        for x in _data(4, 2):
            ref = model.double()(x.double())
            model.float()
            # float32 rounding: a few ops of 2**-24 relative on values up to ~60x the output
            # (the outlier channels): 1e-5 of the output's magnitude bounds that with margin
            assert float((q(x).double() - ref).abs().max() / ref.abs().max()) <= 1e-5


class OutlierLayer(nn.Module):
    """One linear reading a LayerNorm output whose channel 3 is x60 the others (read by a float
    op too, so the division is explicit)."""

    def __init__(self, d: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        with torch.no_grad():
            self.ln.weight[3] = 60.0
            self.fc.weight[:, 3] /= 60.0  # as trained weights do: channel 3 weighs like the rest

    def forward(self, x):
        h = self.ln(x)
        return self.fc(h) + h.mean(-1, keepdim=True)


@pytest.mark.parametrize(
    "model, min_gain_db",
    # measured on held-out data: OutlierLayer 14.0 -> 24.6 dB, OutlierBlock 4.3 -> 29.3 dB
    [(OutlierLayer, 8.0), (OutlierBlock, 20.0)],
)
def test_quantized_error_falls(model, min_gain_db):
    model = model().eval()
    calib, held_out = _data(4, 1), _data(4, 2)
    plain, smoothed = _quantize(model, calib, None), _quantize(model, calib, "auto")
    with torch.no_grad():
        ref = torch.cat([model(x) for x in held_out])
        before = _sqnr_db(ref, torch.cat([plain(x) for x in held_out]))
        after = _sqnr_db(ref, torch.cat([smoothed(x) for x in held_out]))
    print(f"{type(model).__name__} output SQNR: {before:.1f} dB -> {after:.1f} dB")
    assert after >= before + min_gain_db, (before, after)


def test_save_load_and_export(block, tmp_path):
    model, q = block
    qb.save(q, tmp_path / "m.qb")
    loaded = qb.load(tmp_path / "m.qb", model)
    x = _data(1, 3)[0]
    with torch.no_grad():
        expected = q(x)
        assert torch.equal(expected, loaded(x))
    path = tmp_path / "m.onnx"
    qb.export(q, path, x)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    # ORT without graph optimizations runs the QDQ graph node by node in float, as torch's
    # fake-quant does: equal up to float32 rounding of the final float head (no output
    # quantizer: the head's output is the model's output); 1e-4 of the output's range
    scale = float(expected.abs().max())
    assert np.abs(out - expected.numpy()).max() <= 1e-4 * scale
