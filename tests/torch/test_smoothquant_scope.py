"""``Recipe.smoothquant_scope="transformer"``: SmoothQuant only in graphs where a LayerNorm feeds
a linear, and there only on the linear inputs whose channels hold outliers. The float function
is unchanged where it applies, every linear keeps int8 inputs and weights, an input without
outliers is left as it was, and a graph without LayerNorm (a CNN) gets exactly the model it got
without SmoothQuant."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.zoo import DigitsCNN

aten = torch.ops.aten


class TwoNorms(nn.Module):
    """A post-norm block: ``ln_out``'s channel 3 is x60 the others (BERT's LayerNorm outliers),
    its output read by ``fc_a`` and the residual add (an explicit division); ``ln_plain`` has no
    outlier; ``fc_c`` reads a GELU output whose channel 5 is x60 (BERT's feed-forward ones)."""

    def __init__(self, d: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.ln_out, self.ln_plain = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc_a, self.fc_b, self.fc_c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 8)
        with torch.no_grad():
            self.ln_out.weight[3] = 60.0
            self.fc_a.weight[:, 3] /= 60.0  # as trained weights do: the channel weighs like others
            self.fc_b.bias[5] = 60.0
            self.fc_c.weight[:, 5] /= 60.0

    def forward(self, x):
        h = self.ln_out(x)
        g = self.ln_plain(h + self.fc_a(h))
        return self.fc_c(torch.nn.functional.gelu(g + self.fc_b(g)))


def _data(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 8, 32, generator=g) for _ in range(n)]


def _quantize(model, calib, scope):
    recipe = dataclasses.replace(
        qb.Recipe.preset("native"), smoothquant="auto", smoothquant_scope=scope
    )
    return qb.quantize(model, calib, recipe, progress=False)


def _linear_inputs_quantized(qmodel) -> dict[str, bool]:
    """Linear node -> whether its input is a quantizer's output (placement's fake-quant call)."""
    quantizers = {p.attr for p in qmodel.qb_points}
    out = {}
    for n in qmodel.graph.nodes:
        if n.op == "call_function" and n.target is aten.linear.default:
            src = n.args[0]
            out[n.name] = src.op == "call_module" and src.target.split(".")[-1] in quantizers
    return out


@pytest.fixture(scope="module")
def model():
    return TwoNorms().eval()


def test_transformer_scope_smooths_the_outlier_inputs_only(model):
    q = _quantize(model, _data(2, 1), "transformer")
    alphas = q.qb_capture["smoothquant_alphas"]
    assert alphas.keys() == {"layer_norm", "layer_norm_1", "gelu"}
    assert alphas["layer_norm_1"] is None  # no outlier channel: left as it was
    assert alphas["layer_norm"] is not None and alphas["gelu"] is not None
    # the outlier LayerNorm's output is read by the residual too, the GELU's by no layer: both
    # get an explicit division
    assert q.qb_capture["smoothed"] == ["gelu", "layer_norm"]
    assert {p.module for p in q.qb_points if p.kind == "weight"} == {"fc_a", "fc_b", "fc_c"}
    linears = _linear_inputs_quantized(q)
    assert len(linears) == 3 and all(linears.values()), linears
    with torch.no_grad(), qb.float_mode(q):
        for x in _data(2, 2):
            ref = model.double()(x.double())
            model.float()
            # float32 rounding of a few ops on values up to ~60x the output: 1e-5 of its range
            assert float((q(x).double() - ref).abs().max() / ref.abs().max()) <= 1e-5


def test_scope_all_searches_the_outlier_free_input_too(model):
    # what the scope is for: "all" smooths the outlier-free LayerNorm output as well (measured
    # alpha 0.4 here; on a random-weight transformer such smoothing cost 0.28 dB end to end)
    q = _quantize(model, _data(2, 1), "all")
    assert q.qb_capture["smoothquant_alphas"]["layer_norm_1"] is not None


def test_a_graph_without_layer_norm_is_unchanged(scope="transformer"):
    torch.manual_seed(0)
    cnn = DigitsCNN().eval()
    calib = [torch.randn(8, 1, 8, 8) for _ in range(2)]
    base = qb.Recipe.preset("native")
    plain = qb.quantize(cnn, calib, base, progress=False)
    scoped = qb.quantize(
        cnn, calib, dataclasses.replace(base, smoothquant="auto", smoothquant_scope=scope),
        progress=False,
    )  # fmt: skip
    assert scoped.qb_capture["smoothed"] == [] and scoped.qb_capture["smoothquant_alphas"] == {}
    a, b = plain.state_dict(), scoped.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_scope_round_trip_and_bad_value():
    r = dataclasses.replace(qb.Recipe(), smoothquant="auto", smoothquant_scope="transformer")
    assert qb.Recipe.from_dict(r.to_dict()) == r
    assert "smoothquant_scope" not in qb.Recipe().to_dict()  # default recipes serialise as before
    with pytest.raises(ValueError, match="smoothquant_scope='norms'.*'all', 'transformer'"):
        qb.Recipe(smoothquant_scope="norms")
