"""``torch.save(qmodel)`` / ``torch.load(..., weights_only=False)`` (regression: it failed with
"Can't pickle local object 'wrap_dunder_call_ctx_manager.<locals>.inner'", the capture's input-guard
function). The loaded model is a QuantModel that computes bit-identical outputs, keeps training
identically, checks its inputs as before and exports the same ONNX file by the one-trace path."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import quantbridge as qb
from quantbridge.onnx.exporter import _reuse
from quantbridge.onnx.importer._module import OnnxModule
from quantbridge.torch import QuantModel
from quantbridge.torch._pickling import InputGuards
from quantbridge.zoo import DigitsCNN, TwoInputConcat


def _round_trip(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.fixture(scope="module")
def digits():
    torch.manual_seed(0)
    return qb.quantize(DigitsCNN().eval(), [torch.randn(8, 1, 8, 8)], "int8_avx2", progress=False)


def test_round_trip_is_bit_identical(digits):
    loaded = _round_trip(digits)
    assert isinstance(loaded, QuantModel)
    x = torch.randn(5, 1, 8, 8)  # another batch size than calibration's: the batch stays dynamic
    assert torch.equal(loaded(x), digits(x))
    assert loaded.code == digits.code
    before, after = digits.state_dict(), loaded.state_dict()
    assert list(before) == list(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert loaded.summary() == digits.summary()
    # the captured values come back with the same (symbolic) sizes and dtypes
    for a, b in zip(digits.graph.nodes, loaded.graph.nodes, strict=True):
        assert a.name == b.name
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor):
            assert (str(va.shape), va.dtype) == (str(vb.shape), vb.dtype)
        assert a.meta.get("nn_module_stack") == b.meta.get("nn_module_stack")
    assert torch.equal(copy.deepcopy(loaded)(x), digits(x))


def test_loaded_model_checks_its_inputs_as_before(digits):
    loaded = _round_trip(digits)
    with pytest.raises(ValueError, match=r"input 'x': expected shape \[batch, 1, 8, 8\]"):
        loaded(torch.randn(2, 1, 9, 8))
    # the guard module that replaces torch's generated one checks on its own too
    assert isinstance(loaded._guards_fn, InputGuards)
    loaded._forward_pre_hooks.clear()
    with pytest.raises(
        ValueError, match=r"input 'x': dimension 2 is 9; the captured model needs 8"
    ):
        loaded(torch.randn(2, 1, 9, 8))
    assert loaded(torch.randn(1, 1, 8, 8)).shape == (1, 10)  # batch 1 passes, as before


def test_guards_relate_inputs_and_scalars():
    batch = {"image": torch.randn(2, 3, 8, 8), "extra": torch.randn(2, 6), "scale": 2.0}
    qmodel = qb.quantize(TwoInputConcat(), [batch], progress=False)
    loaded = _round_trip(qmodel)
    image, extra = torch.randn(3, 3, 8, 8), torch.randn(3, 6)
    assert torch.equal(loaded(image, extra, scale=2.0), qmodel(image, extra, scale=2.0))
    with pytest.raises(
        ValueError, match=r"input 'extra': dimension 0 is 4; .* dimension 0 of input 'image'"
    ):
        loaded(image, torch.randn(4, 6), scale=2.0)
    with pytest.raises(ValueError, match=r"input 'scale' is 3.0; the model was captured with 2.0"):
        loaded(image, extra, scale=3.0)


def test_training_continues_identically():
    torch.manual_seed(0)
    qat = qb.prepare_qat(DigitsCNN(), calib_data=[torch.randn(8, 1, 8, 8)], learn_scales=True)
    qat.train()
    loaded = _round_trip(qat)
    assert loaded.training
    for model in (qat, loaded):
        g = torch.Generator().manual_seed(3)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(2):
            loss = model(torch.randn(4, 1, 8, 8, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    x = torch.randn(4, 1, 8, 8)
    assert torch.equal(qat.eval()(x), loaded.eval()(x))


def test_loaded_model_exports_the_same_file(digits, tmp_path):
    loaded = _round_trip(digits)
    x = torch.randn(2, 1, 8, 8)
    assert _reuse.reuse_refusal(loaded, (x,), {}, "batch") is None  # the one-trace path
    qb.export(digits, tmp_path / "a.onnx", x)
    qb.export(loaded, tmp_path / "b.onnx", x)
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()

    # a model imported from that file: its float module (of classes made at import) travels too
    imported = qb.import_onnx(tmp_path / "a.onnx")
    loaded = _round_trip(imported)
    assert isinstance(loaded, QuantModel) and isinstance(loaded._qb_source, OnnxModule)
    assert torch.equal(loaded(x), imported(x))
    assert torch.equal(loaded._qb_source(x), imported._qb_source(x))


def test_deepcopy_behaves_like_the_original(digits):
    """Regression: ``GraphModule.__deepcopy__`` re-initialises the copy and keeps only state-dict
    hooks, so ``copy.deepcopy(qmodel)`` lost the input check (a wrong size failed deep inside
    torch's guard with "Guard failed: x.size()[2] == 8") and came back in training mode."""
    clone = copy.deepcopy(digits)
    assert clone.training is False and digits.training is False
    x = torch.randn(5, 1, 8, 8)
    assert torch.equal(clone(x), digits(x))
    bad = torch.randn(2, 1, 9, 8)
    with pytest.raises(ValueError) as original:
        digits(bad)
    with pytest.raises(ValueError) as copied:
        clone(bad)
    assert str(copied.value) == str(original.value)
    assert "input 'x': expected shape [batch, 1, 8, 8]" in str(copied.value)
    # the copy's hooks are its own: removing them leaves the original's in place
    clone._forward_pre_hooks.clear()
    with pytest.raises(ValueError):
        digits(bad)
