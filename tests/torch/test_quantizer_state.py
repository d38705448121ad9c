"""A quantizer's life cycle (issue 8): exactly one ``QState``, moves checked, bad parameters
refused with the quantizer's name, the state carried by ``state_dict()``, export a context."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import quantbridge as qb
from quantbridge.recipe import resolve_recipe
from quantbridge.torch._export_ops import export_mode
from quantbridge.torch._fakequant import QState, Quantizer, WeightQuantizer
from quantbridge.zoo import DigitsCNN

RECIPE = resolve_recipe("int8")


def _calibrated(name: str = "block/relu") -> Quantizer:
    q = Quantizer(name, RECIPE.activations, "activation")
    q(torch.linspace(-1.0, 3.0, 101))
    q.freeze()
    return q


def test_life_cycle_moves_and_refusals():
    q = Quantizer("block/relu", RECIPE.activations, "activation")
    assert q.qstate is QState.CALIBRATING and int(q.state) == 0
    with pytest.raises(ValueError, match=r"'block/relu' is still calibrating"):
        q.make_learnable()
    with pytest.raises(ValueError, match=r"'block/relu' saw no data"):
        q.freeze()
    q(torch.linspace(-1.0, 3.0, 101))
    q.freeze()
    assert q.qstate is QState.FROZEN and int(q.state) == 1
    q.track()
    assert q.qstate is QState.TRACKING and q.tracking and not q.observing
    q.stop_tracking()
    assert q.qstate is QState.FROZEN
    q.make_learnable()
    assert q.qstate is QState.LEARNED and isinstance(q.log_scale, torch.nn.Parameter)
    for move in (q.track, q.freeze):
        with pytest.raises(ValueError, match=r"'block/relu' is learned and cannot become"):
            move()
    q.make_learnable()  # already learned: nothing to do
    assert q.qstate is QState.LEARNED


@pytest.mark.parametrize(
    ("scale", "zero_point", "match"),
    [
        (0.0, 0, "scale must be finite and > 0"),
        (-0.1, 0, "scale must be finite and > 0"),
        (float("nan"), 0, "scale must be finite and > 0"),
        (float("inf"), 0, "scale must be finite and > 0"),
        (0.1, 300, r"zero point must be an integer in \[0, 255\]"),
        (0.1, 1.5, r"zero point must be an integer in \[0, 255\]"),
        (0.1, float("nan"), "zero point must be finite"),
        ([0.1, 0.2], [1, 2, 3], "2 scales but 3 zero points"),
    ],
)
def test_invalid_qparams_raise_value_error_naming_the_quantizer(scale, zero_point, match):
    q = _calibrated()
    before = (q.scale.clone(), q.zero_point.clone(), q.qstate)
    with pytest.raises(ValueError, match=rf"activation quantizer 'block/relu': {match}"):
        q.set_qparams(scale, zero_point)
    assert torch.equal(q.scale, before[0]) and torch.equal(q.zero_point, before[1])
    assert q.qstate is before[2]


def test_set_qparams_freezes_a_calibrating_quantizer_and_keeps_a_tracking_one():
    q = Quantizer("x", RECIPE.activations, "activation")
    q.set_qparams(np.float32(0.5), np.int32(3))
    assert q.qstate is QState.FROZEN
    assert q.scale.item() == 0.5 and q.zero_point.item() == 3
    q.track()
    q.set_qparams(0.25, 7)
    assert q.qstate is QState.TRACKING and q.scale.item() == 0.25


def test_tracking_uses_the_moving_average_of_calibrate():
    """The moving average has one home: calibrate's observer (constant 0.01), per batch."""
    q = _calibrated()
    q.track()
    q.train()
    batches = [torch.randn(64) * s for s in (1.0, 4.0, 0.5)]
    lo = hi = None
    for b in batches:
        q(b)
        m, big = b.min().double().item(), b.max().double().item()
        lo, hi = (m, big) if lo is None else (lo + 0.01 * (m - lo), hi + 0.01 * (big - hi))
    state = q.tracker_state()
    assert state["method"] == "moving_average_minmax" and state["batches"] == 3
    assert (state["min"], state["max"]) == (lo, hi)  # float64, same order of operations


def test_state_travels_in_the_state_dict():
    """A plain torch state dict carries every quantizer's state: a fresh placed model (all
    calibrating) loads a QAT model's learned and tracking quantizers and computes the same."""
    torch.manual_seed(0)
    data = [torch.randn(8, 1, 8, 8)]
    qm = qb.prepare_qat(DigitsCNN(), "int8", data, learn_scales=True, progress=False)
    q = qb.prepare_qat(DigitsCNN(), "int8", data, progress=False)
    for model in (qm, q):
        fresh = qb.torch.prepare(DigitsCNN(), (data[0],), {}, model.qb_recipe, fold_bn=False)
        fresh.load_state_dict(model.state_dict())
        states = [m.qstate for m in fresh.quantizers().values() if isinstance(m, Quantizer)]
        assert states == [m.qstate for m in model.quantizers().values() if isinstance(m, Quantizer)]
        x = torch.randn(4, 1, 8, 8)
        with torch.no_grad():
            assert torch.equal(fresh.eval()(x), model.eval()(x))


def test_export_is_a_context_not_a_state():
    wq = WeightQuantizer("conv.weight", RECIPE.weights, axis=0)
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.randn(4, 3, 3, 3))
    wq.weight_name = "weight"
    model.q = wq
    wq.compute_from(model.weight)
    assert not hasattr(wq, "export_mode")
    with export_mode(model):
        assert wq.qstate is QState.FROZEN and "export_qweight" in wq._buffers
        exported = wq(model.weight)
    assert "export_scale" not in wq._buffers and wq.qstate is QState.FROZEN
    assert torch.equal(exported, wq(model.weight))  # the same values in and out of export
