"""Output distillation (``Recipe.distill_steps``, ``quantbridge.torch.ptq._distill``): the learned
weight gains and biases lower the output error against the float model on the calibration data
(float64 reference), scales stay finite and positive, the integer weights are PTQ's, and the
exported file runs in ONNX Runtime as torch simulates it (within 1 LSB)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.torch._fakequant import QState, Quantizer, WeightQuantizer
from quantbridge.torch.ptq._distill import distill


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.ReLU(),
        nn.Conv2d(8, 4, 1),
    ).eval()


def _data(seed: int, n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 8, 8, generator=g) for _ in range(n)]


# 4-bit weights: a large error for the gains and biases to take back, on a model small enough
# for 60 steps in about a second
RECIPE = qb.Recipe.preset("w4a8")


@pytest.fixture(scope="module")
def pair():
    """(float model, calibration batches, PTQ model, the same distilled): one capture."""
    m, data = _model(), _data(1)
    plain = qb.quantize(m, data, recipe=RECIPE, progress=False)
    tuned = copy.deepcopy(plain)
    result = distill(tuned, m, [((x,), {}) for x in data], 60, progress=False)
    assert result.kept and result.loss_after < result.loss_before  # on its held-out batch
    return m, data, plain, tuned


def _error(qm, reference, data) -> float:
    """Squared output error summed in float64 over the batches, against ``reference`` (float64)."""
    with torch.no_grad():
        return sum(float(((qm(x).double() - reference(x.double())) ** 2).sum()) for x in data)


def test_distilled_error_on_calibration_data_is_lower_than_ptq(pair):
    m, data, plain, tuned = pair
    reference = copy.deepcopy(m).double()  # independent: the float model in float64
    before, after = _error(plain, reference, data), _error(tuned, reference, data)
    # measured 0.72x (0.70x on fresh data from the same distribution); the implementation keeps
    # a result only if its held-out batch's float32 loss fell, so a 0.9 bound tests that it
    # learns something across the batches, not only that it does no harm
    assert after < 0.9 * before, (before, after)


def test_scales_positive_and_integer_weights_unchanged(pair):
    _, _, plain, tuned = pair
    quantizers = [m for m in tuned.modules() if isinstance(m, Quantizer)]
    assert quantizers
    for q in quantizers:
        assert q.qstate is QState.FROZEN, q.name
        assert torch.isfinite(q.scale).all() and (q.scale > 0).all(), q.name
        assert not hasattr(q, "log_scale"), q.name  # no Parameter left from learning
    moved = 0
    for q in (m for m in tuned.modules() if isinstance(m, WeightQuantizer)):
        p = plain.get_submodule(_path(tuned, q))
        codes_t = q.quantize_integers(tuned.get_parameter(q.weight_name))
        codes_p = p.quantize_integers(plain.get_parameter(p.weight_name))
        assert torch.equal(codes_t, codes_p), q.name  # the codes are frozen; the gain is in s
        moved += int(not torch.equal(q.scale, p.scale))
    assert moved  # at least one layer's weight scale learned a gain


def _path(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def test_exported_file_matches_torch_in_onnx_runtime(pair, tmp_path):
    _, _, _, tuned = pair
    x = torch.cat(_data(4, 2))
    path = tmp_path / "distilled.onnx"
    qb.export(tuned, path, x[:2], opset=18)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y_ort = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        y = tuned(x).numpy()
    # quantized output: both sides agree but where a float32 sum lands on a rounding tie
    lsb = np.abs(y_ort - y) / tuned.output_quantizer().scale.item()
    assert lsb.max() <= 1.0 + 1e-3, lsb.max()


def test_quantize_runs_it_from_the_recipe():
    """``Recipe.distill_steps`` wires it into ``quantize`` (same seed: the same weights as the
    direct call on a PTQ model with the same steps)."""
    m, data = _model(), _data(1)
    recipe = dataclasses.replace(RECIPE, distill_steps=8)
    a = qb.quantize(m, data, recipe=recipe, progress=False)
    b = qb.quantize(m, data, recipe=RECIPE, progress=False)
    distill(b, m, [((x,), {}) for x in data], 8, progress=False)
    for name, _ in m.named_parameters():
        assert torch.equal(a.get_parameter(name), b.get_parameter(name)), name


def test_recipe_option_round_trip_and_error():
    r = dataclasses.replace(RECIPE, distill_steps=200)
    assert qb.Recipe.from_dict(r.to_dict()) == r
    assert "distill_steps" not in RECIPE.to_dict()  # off: serialised as before
    with pytest.raises(ValueError, match="distill_steps"):
        qb.Recipe(distill_steps=-1)


def test_fix_learned_turns_a_learned_quantizer_back_into_a_frozen_one():
    """``Quantizer.fix_learned``: LEARNED -> FROZEN with the learned scale and the learned zero
    point rounded onto the grid as buffers (asymmetric uint8, so both were Parameters)."""
    q = qb.Recipe.preset("int8").activations
    quantizer = Quantizer("x", q, "activation")
    quantizer.set_qparams(0.1, 128)
    quantizer.make_learnable()
    with torch.no_grad():
        quantizer.log_scale.fill_(float(np.log(0.05)))
        quantizer.zero_point.fill_(130.4)
    quantizer.fix_learned()
    assert quantizer.qstate is QState.FROZEN
    assert not any(isinstance(p, nn.Parameter) for p in quantizer.parameters())
    assert "zero_point" in dict(quantizer.named_buffers())
    assert quantizer.zero_point.dtype == torch.int32 and int(quantizer.zero_point) == 130
    assert torch.allclose(quantizer.scale, torch.tensor(0.05))
    x = torch.linspace(-3, 3, 101)
    expected = (torch.clamp(torch.round(x / 0.05) + 130, 0, 255) - 130) * 0.05
    torch.testing.assert_close(quantizer(x), expected, rtol=0, atol=1e-6)  # float32 product


def test_saved_and_loaded_distilled_model_computes_the_same(pair, tmp_path):
    """A checkpoint carries the learned weight scales, grid weights and biases (``load``
    rebuilds with ``prepare`` only, so it does not distill again): bit-identical outputs."""
    m, _, _, tuned = pair
    path = tmp_path / "distilled.qb"
    qb.save(tuned, path)
    loaded = qb.load(path, m)
    x = torch.cat(_data(5, 2))
    with torch.no_grad():
        assert torch.equal(loaded(x), tuned(x))
