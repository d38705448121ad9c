"""``sensitivity`` lists a layer whose ops all run float (a LayerNorm: its quantizers are its
output where the next linear reads it) as not repairable, says which layers to repair instead,
and leaves it out of the repair; the verified repair re-quantizes at most ``max_verify`` times.

The model is test_sensitivity's outlier MLP with a LayerNorm before ``fc2`` (``outlier_mlp``): ``fc2`` has one
output channel ~1000x the others, so the repair keeps ``fc2`` and ``fc3`` (which reads that
tensor) float."""

from __future__ import annotations

import warnings

import pytest
import torch
from outlier_mlp import Outlier

import quantbridge as qb
from quantbridge.debug import sensitivity

BUDGET = 0.999


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = Outlier(norm=True).eval()
    x = torch.randn(64, 16)
    return model, [x[:32]], [x[32:48], x[48:]]


def _run(setup, **kwargs):
    model, calib, evaluation = setup
    return sensitivity(
        model, calib, evaluation, metric="cosine", budget=BUDGET, progress=False, **kwargs
    )


@pytest.fixture(scope="module")
def uncapped(setup):
    return _run(setup, max_verify=10)


def test_a_float_layer_is_listed_as_not_repairable_and_left_out_of_the_repair(setup, uncapped):
    result = uncapped
    layers = {s.name: s for s in result.layers}
    assert "ln" in layers  # it owns a quantizer (its output, as fc2 reads it)
    ln = layers["ln"]
    assert not ln.repairable and "'fc2'" in ln.note
    assert all(s.repairable and s.note == "" for name, s in layers.items() if name != "ln")
    assert ln.rank == len(layers)  # after every repairable layer
    assert "ln" not in result.keep_float and result.achieved >= BUDGET
    data = result.to_json()
    assert {r["name"]: r["repairable"] for r in data["layers"]}["ln"] is False
    # independent of the library's reasoning: a rule naming ln places the same quantizers
    model, calib, _ = setup
    plain = qb.quantize(model, calib, "native", progress=False)
    skip = qb.Recipe.preset("native").with_rules(qb.Rule(pattern="ln", skip=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ruled = qb.quantize(model, calib, skip, progress=False)
    assert [p.attr for p in ruled.qb_points] == [p.attr for p in plain.qb_points]
    assert any("matches no layer" in str(w.message) for w in caught)


def test_pruning_stops_when_max_verify_is_spent(setup, uncapped):
    """Growing takes two verifications here (``fc2`` alone misses; its reader ``fc3`` joins);
    with room, pruning then tries both kept layers (neither can go back to int8: each alone
    leaves the outlier tensor quantized): 4 in all. ``max_verify=3`` leaves one trial."""
    assert uncapped.verified == 4 and uncapped.keep_float == ["fc2", "fc3"]
    capped = _run(setup, max_verify=3)
    assert capped.verified == 3 and capped.keep_float == ["fc2", "fc3"]
    assert capped.achieved == pytest.approx(uncapped.achieved) and capped.achieved >= BUDGET


class _TopLevelOps(torch.nn.Module):
    """A squeeze-excitation block and a global average pool written in the model's own forward
    (no module of their own)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.se = torch.nn.Linear(8, 8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        y = self.conv(x)
        gate = torch.sigmoid(self.se(y.mean((2, 3))))
        y = y * gate[:, :, None, None]
        return self.fc(y.mean((2, 3)))


def test_top_level_ops_are_rows_named_after_their_node_not_one_empty_name():
    """Regression: every quantizer outside a module was one row named '' (op: the model class):
    the GAP means and the SE mul lumped together, unnamed in the table and the JSON."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 8, 8)
    result = sensitivity(_TopLevelOps().eval(), [x], [x], progress=False)
    rows = {r["name"]: r for r in result.to_json()["layers"]}
    assert "" not in rows
    top = {name: r["op"] for name, r in rows.items() if not r["repairable"]}
    assert {"mean", "mul", "mean_1"} <= set(top) and top["mean"] == "mean" and top["mul"] == "mul"
    assert all("Rule(pattern=''" in rows[name]["note"] for name in top)
    assert {"conv", "se", "fc"} <= {name for name, r in rows.items() if r["repairable"]}
