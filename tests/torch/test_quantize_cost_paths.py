"""The cheaper paths of ``quantize`` / ``export`` give exactly what the plain ones give.

* histogram counting (``calibrate._histogram``): torch's kernels, a slice at a time, against the
  float64 numpy path, on every activation a real calibration of three models observed;
* the export's saturation check reads each weight's extreme codes from its extrema
  (``torch._export_ops.code_extremes``) instead of quantizing the whole weight;
* ``prepare`` folds batch norms before copying the captured tensors, and copies only those the
  capture shares with the user's model: the user's tensors are still never written nor shared;
* bias correction's float64 channel sums through a reused buffer (``ptq._sequential.Float64Sums``)
  and max pooling on a channels-last copy (``torch._kernels``): the same numbers as torch's own
  calls, and the default preset's quantized model bit-identical with and without them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from torch import nn

import quantbridge as qb
from quantbridge.calibrate import _base, _histogram
from quantbridge.torch import _kernels
from quantbridge.torch._export_ops import code_extremes
from quantbridge.torch._fakequant import Quantizer, WeightQuantizer
from quantbridge.torch.ptq import _sequential
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


def test_float64_sums_through_one_buffer_are_torchs_sums():
    sums = _sequential.Float64Sums()
    g = torch.Generator().manual_seed(0)
    # the largest first, then smaller ones in its buffer, then one that grows it; 1-D and 2-D
    shapes = [((4, 8, 30, 30), (0, 2, 3)), ((2, 8, 5, 5), (0, 2, 3)), ((6, 3, 40, 41), (0, 2, 3)),
              ((3, 7, 16), (0, 1)), ((50, 9), (0,))]  # fmt: skip
    for shape, dims in shapes:
        y = torch.randn(shape, generator=g) * torch.logspace(-6, 6, shape[-1])  # wide exponents
        assert torch.equal(sums(y, dims), y.sum(dim=dims, dtype=torch.float64)), shape
    strided = torch.randn(4, 8, 10, 12, generator=g)[:, :, ::2]  # not contiguous: torch's own call
    assert torch.equal(sums(strided, (0, 2, 3)), strided.sum(dim=(0, 2, 3), dtype=torch.float64))


@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil", [
    (3, 2, 1, 1, False), (2, 2, 0, 1, False), (3, 1, 1, 2, False), (3, 2, 1, 1, True),
    (5, 3, 2, 1, True),
])  # fmt: skip
def test_max_pool_on_a_channels_last_copy_gives_torchs_values(kernel, stride, padding, dilation,
                                                               ceil):  # fmt: skip
    g = torch.Generator().manual_seed(kernel * 10 + stride)
    x = torch.randn(2, 5, 17, 19, generator=g)
    x[0, 0, 3, 4], x[1, 2, 5, 5], x[1, 3, 7, 7] = float("nan"), float("inf"), -float("inf")
    x[0, 4] = -float("inf")  # a channel of -inf only
    call = ([kernel] * 2, [stride] * 2, [padding] * 2, [dilation] * 2, ceil)
    want = torch.ops.aten.max_pool2d.default(x, *call)
    with torch.no_grad(), _kernels.faster_kernels():
        got = torch.ops.aten.max_pool2d.default(x, *call)
    assert got.stride() == want.stride()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(nan=7.0), want.nan_to_num(nan=7.0))


def test_default_quantize_is_the_same_without_the_faster_paths(monkeypatch):
    """The default preset (calibration, sequential bias correction) on a ResNet-like stem (batch
    norms folded into corrected biases, a max pool): bit-identical state with torch's own calls."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(8, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    ).eval()  # fmt: skip
    data = [torch.randn(4, 3, 32, 32) for _ in range(2)]
    fast = qb.quantize(model, data, progress=False).state_dict()
    monkeypatch.setattr(_kernels, "FASTER", {})
    monkeypatch.setattr(
        _sequential.Float64Sums, "__call__", lambda self, y, dims: y.sum(dims, dtype=torch.float64)
    )
    plain = qb.quantize(model, data, progress=False).state_dict()
    assert fast.keys() == plain.keys()
    assert [k for k in fast if not torch.equal(fast[k], plain[k])] == []
