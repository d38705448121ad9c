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


class _DeadThenLive(torch.nn.Module):
    """conv ``a`` -> relu -> conv ``b``: with ``dead``, ``a`` outputs a negative constant, so the
    relu'd tensor ``b`` reads is zero on every calibration batch (a dead layer)."""

    def __init__(self, dead: bool):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Conv2d(4, 2, 1)
        if dead:
            with torch.no_grad():
                self.a.weight.zero_()
                self.a.bias.fill_(-1.0)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _calibration_warnings(model, batches) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qb.quantize(model.eval(), batches, progress=False)
    return [str(w.message) for w in caught if "calibration saw only zeros" in str(w.message)]


def test_calibration_that_saw_only_zeros_warns_naming_the_tensor():
    """Before: an all-zero calibrated range got the fallback scale and the layer reading it was
    quantized to a constant without a word (a degenerate random-init EfficientNet: 65 such
    tensors, outputs 1e-42). Also values below half a step: 1e-30 inputs, whose range is under
    the scale floor 2**-23, all round to the zero point."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 3, 6, 6, generator=g) for _ in range(2)]
    (message,) = _calibration_warnings(_DeadThenLive(dead=True), batches)
    assert "1 tensor(s): 'a/conv2d' (max |x| 0)" in message and "calibration data" in message
    (message,) = _calibration_warnings(_DeadThenLive(dead=False), [x * 1e-30 for x in batches])
    assert "'input/x'" in message
    assert _calibration_warnings(_DeadThenLive(dead=False), batches) == []
