"""Calibration data as users have it: DataLoaders with transform=, forward_loop=, progress."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import quantbridge as qb
from quantbridge.zoo import DigitsCNN


def _scales(qm) -> dict[str, torch.Tensor]:
    return {k: q.scale.clone() for k, q in qm.quantizers().items() if hasattr(q, "scale")}


def test_dataloader_of_inputs_and_labels_with_transform_equals_plain_batches():
    torch.manual_seed(0)
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    model = DigitsCNN().eval()
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    a = qb.quantize(model, loader, transform=lambda batch: batch[0], recipe="int8")
    b = qb.quantize(model, list(x.split(16)), recipe="int8")
    for name, scale in _scales(a).items():
        assert torch.equal(scale, _scales(b)[name]), name


def test_forward_loop_equals_plain_batches():
    torch.manual_seed(0)
    x = torch.randn(64, 1, 8, 8)
    model = DigitsCNN().eval()

    def loop(m):
        for batch in x.split(16):
            m(batch)

    a = qb.quantize(model, forward_loop=loop, recipe="int8")
    b = qb.quantize(model, list(x.split(16)), recipe="int8")
    for name, scale in _scales(a).items():
        assert torch.equal(scale, _scales(b)[name]), name


def test_max_batches_limits_calibration():
    x = torch.randn(64, 1, 8, 8)
    x[48:] *= 100  # the last batch would widen the input range
    a = qb.quantize(DigitsCNN().eval(), list(x.split(16)), max_batches=3, recipe="int8")
    assert a.quantizers()["input/x"].scale < x[:48].abs().max() / 100


def test_progress_bar_can_be_forced_on(capsys):
    qb.quantize(DigitsCNN().eval(), [torch.randn(4, 1, 8, 8)] * 3, progress=True, recipe="int8")
    assert "calibrating" in capsys.readouterr().err


def test_persistent_float_switch_never_changes_weights():
    qm = qb.quantize(DigitsCNN().eval(), [torch.randn(8, 1, 8, 8)], recipe="int8")
    before = {k: v.clone() for k, v in qm.state_dict().items()}
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        y_int8 = qm(x)
        qm.set_quantization(False)
        assert not qm.quantization_enabled
        y_float = qm(x)
        qm.set_quantization(True)
        assert torch.equal(qm(x), y_int8)
    assert not torch.equal(y_float, y_int8)
    for k, v in qm.state_dict().items():
        assert torch.equal(v, before[k]), k
