"""Format-1 checkpoints (written before quantizer states: flags in the header, a ``calibrated``
buffer) still load. The files in ``data/`` were written by qb.save at commit 297f1fa from
DigitsCNN: post-training quantized (``v1_ptq``), QAT with moving-average ranges saved in training
mode (``v1_tracking``) and QAT with LSQ after freeze_batchnorm (``v1_learned``);
``v1_outputs.safetensors`` holds what each computed then on the fixed input below (eval mode).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import quantbridge as qb
from quantbridge.torch._fakequant import QState, Quantizer, WeightQuantizer
from quantbridge.zoo import DigitsCNN

DATA = Path(__file__).parent / "data"
X = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(5))


def _activation_states(qm) -> set[QState]:
    return {
        q.qstate
        for q in qm.quantizers().values()
        if isinstance(q, Quantizer) and q.kind == "activation"
    }


@pytest.mark.parametrize(
    ("name", "states"),
    [
        ("ptq", {QState.FROZEN}),
        ("tracking", {QState.TRACKING}),
        ("learned", {QState.LEARNED}),
    ],
)
def test_format_1_checkpoint_loads_with_its_states_and_outputs(name, states):
    path = DATA / f"v1_{name}.qb"
    with safe_open(path, "pt") as f:
        assert f.metadata()["format_version"] == "1"
        assert any(k.endswith(".calibrated") for k in f.keys())
    qm = qb.load(path, DigitsCNN())
    assert _activation_states(qm) == states
    # bit-identical to what the model computed when it was saved (eval mode: no tracking step)
    expected = load_file(DATA / "v1_outputs.safetensors")[name]
    with torch.no_grad():
        assert torch.equal(qm.eval()(X), expected)
    # QAT weight ranges follow the weights until freeze_observers; otherwise they are fixed
    weights = [q for q in qm.quantizers().values() if isinstance(q, WeightQuantizer)]
    assert weights and all(q.qstate is not QState.CALIBRATING for q in weights) == (
        name != "tracking"
    )


def test_format_1_tracking_checkpoint_restores_the_moving_average(tmp_path):
    qm = qb.load(DATA / "v1_tracking.qb", DigitsCNN())
    trackers = [
        q.tracker_state()
        for q in qm.quantizers().values()
        if isinstance(q, Quantizer) and q.kind == "activation"
    ]
    assert trackers and all(t is not None and t["min"] <= t["max"] for t in trackers)
    qb.save(qm, tmp_path / "v2.qb")
    again = qb.load(tmp_path / "v2.qb", DigitsCNN())
    assert [
        q.tracker_state()
        for q in again.quantizers().values()
        if isinstance(q, Quantizer) and q.kind == "activation"
    ] == trackers
    step = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(qm.train()(step), again.train()(step))  # one tracking step, same result
