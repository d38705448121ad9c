"""The cheaper paths of ``quantize`` / ``export`` give exactly what the plain ones give.

* histogram counting (``calibrate._histogram``): torch's kernels, a slice at a time, against the
  float64 numpy path, on every activation a real calibration of three models observed;
* the export's saturation check reads each weight's extreme codes from its extrema
  (``torch._export_ops.code_extremes``) instead of quantizing the whole weight;
* ``prepare`` folds batch norms before copying the captured tensors, and copies only those the
  capture shares with the user's model: the user's tensors are still never written nor shared.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import quantbridge as qb
from quantbridge.calibrate import _base, _histogram
from quantbridge.torch._export_ops import code_extremes
from quantbridge.torch._fakequant import Quantizer, WeightQuantizer
from quantbridge.zoo import DigitsCNN, TinyTransformer, resnet18_style


def _image(n):
    return torch.randn(n, 3, 32, 32)


MODELS = {  # name: (model, batch of n)
    "resnet18_style": (lambda: resnet18_style(num_classes=10, width=8), _image),
    "digits_cnn": (DigitsCNN, lambda n: torch.randn(n, 1, 8, 8)),
    "tiny_transformer": (TinyTransformer, lambda n: torch.randint(0, 100, (n, 16))),
}


def _percentile():
    base = qb.Recipe.preset("int8")
    act = qb.TensorRecipe(base.activations.scheme, "percentile", (("percentile", 99.9),))
    return qb.Recipe(weights=base.weights, activations=act)


def _quantize(name: str, recipe=None):
    make, batch = MODELS[name]
    torch.manual_seed(0)
    model = make().eval()
    data = [batch(4) for _ in range(2)]
    kwargs = {} if recipe is None else {"recipe": recipe}
    return model, qb.quantize(model, data, progress=False, **kwargs)


@pytest.mark.parametrize(
    "name",
    [
        "digits_cnn",
        "tiny_transformer",
        pytest.param("resnet18_style", marks=pytest.mark.slow),  # ~8 s on two quiet cores
    ],
)
def test_sliced_torch_counting_observes_as_the_numpy_path(monkeypatch, name):
    # every activation a real calibration fed an observer, counted again a few thousand values
    # at a time through torch and whole through numpy: the same histograms, extrema and counts
    seen: list[tuple[Quantizer, torch.Tensor]] = []
    observe = Quantizer.observe

    def recording(self, x):
        seen.append((self, x.detach().clone()))
        observe(self, x)

    monkeypatch.setattr(Quantizer, "observe", recording)
    _, qmodel = _quantize(name, _percentile())
    assert seen
    for paths in ({"_TORCH_MIN_SIZE": 0, "_SLICE": 4_099}, {"_TORCH_MIN_SIZE": 1 << 62}):
        for attr, value in paths.items():
            monkeypatch.setattr(_base if attr == "_TORCH_MIN_SIZE" else _histogram, attr, value)
        again = {q: q._new_observer() for q, _ in seen}
        for q, x in seen:
            again[q].update(x)
        for q, obs in again.items():
            mine, real = obs.state_dict(), q.observer.state_dict()
            assert mine.keys() == real.keys()
            for key in mine:
                np.testing.assert_array_equal(mine[key], real[key], err_msg=f"{q.name}: {key}")
    # the saturation check's shortcut, on every weight of a real model
    for q in qmodel.quantizers().values():
        if getattr(q, "kind", "") == "weight":
            w = qmodel.get_parameter(q.weight_name)
            codes = q.quantize_integers(w)
            ends = code_extremes(q, w)
            assert (ends.min(), ends.max()) == (codes.min(), codes.max())


weights = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=1, max_dims=4, max_side=5),
    elements=st.floats(-1e4, 1e4, width=32) | st.sampled_from([np.inf, -np.inf, 0.0, -0.0]),
)


@settings(max_examples=60, deadline=None)
@given(weights, st.booleans(), st.integers(0, 3), st.floats(0.05, 2.0))
def test_code_extremes_are_the_extremes_of_the_codes(w, per_channel, axis, shrink):
    # int8 per channel along any axis, or uint8 per tensor (a zero point off 0); a scale shrunk
    # below the range saturates codes
    w = torch.from_numpy(w)
    per_channel = per_channel and axis < w.ndim
    preset = qb.Recipe.preset("int8")
    q = WeightQuantizer("w", preset.weights if per_channel else preset.activations, axis)
    assert (q.axis is not None) == per_channel
    q.compute_from(torch.where(w.isfinite(), w, torch.zeros_like(w)))
    q.set_qparams(q.scale * shrink, q.zero_point)
    codes, ends = q.quantize_integers(w), code_extremes(q, w)
    assert (ends.min(), ends.max()) == (codes.min(), codes.max())
    dims = [d for d in range(w.ndim) if d != axis]
    if per_channel and dims:  # each channel's own extremes
        lo, hi = ends.reshape(2, -1)
        assert torch.equal(lo, codes.amin(dim=dims)) and torch.equal(hi, codes.amax(dim=dims))


def test_code_extremes_of_a_weight_holding_nan_quantize_it_whole():
    # NaN quantizes to the zero point, not as an extreme: the shortcut does not apply
    q = WeightQuantizer("w", qb.Recipe.preset("int8").activations, 0)
    q.compute_from(torch.tensor([0.5, 1.0, 2.0]))
    w = torch.tensor([float("nan"), 1.0, 2.0])
    assert torch.equal(code_extremes(q, w), q.quantize_integers(w))


@pytest.mark.parametrize(
    "recipe",
    ["int8", None, qb.Recipe(equalize=True, bias_correction=True, quantize_outputs=False)],
)
def test_quantize_never_writes_nor_shares_the_users_tensors(recipe):
    # DigitsCNN: two convs with batch norms (folded: new tensors), one conv and two linears
    # without (copied), and the batch norms' buffers; equalization rewrites weights in place
    torch.manual_seed(0)
    model = DigitsCNN().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = [torch.randn(4, 1, 8, 8) for _ in range(2)]
    kwargs = {} if recipe is None else {"recipe": recipe}
    qmodel = qb.quantize(model, data, progress=False, **kwargs)
    after = model.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    users = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    ours = {t.untyped_storage().data_ptr() for t in (*qmodel.parameters(), *qmodel.buffers())}
    assert users.isdisjoint(ours)
    if recipe != "int8":
        return  # bias correction (the default recipe has it) changes the float function on purpose
    # the quantized model still follows the float one (the folds and copies are right)
    with torch.no_grad(), qb.float_mode(qmodel):
        torch.testing.assert_close(qmodel(data[0]), model(data[0]), rtol=1e-4, atol=1e-5)
