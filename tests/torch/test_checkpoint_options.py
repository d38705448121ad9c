"""A QuantModel quantized with every opt-in rewrite of the recipe at once (``split_ranges``,
``equalize``, ``fold_affine``, ``smoothquant``, ``adaround``) survives both checkpoint forms:
``qb.save`` / ``qb.load`` onto a fresh instance and ``torch.save`` / ``torch.load`` of the whole
object give bit-identical outputs and export byte-identical ONNX files.

(Session 10 reported that ``torch.load`` of a split PP-OCRv4 det gave a model failing on forward,
"weight of size [48, 32, 1, 1], expected input[1, 19, 120, 120]". Rerun, the loaded model was
fine: the script's forward hook on the quantizers returned ``got.setdefault(k, out)``, and a hook
that returns a value replaces the module's output, so the second call of a quantizer shared by
the split's ``x_g * k_g`` parts returned the first part's tensor.)"""

from __future__ import annotations

import io
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.torch._quantizer import Quantizer


class Everything(nn.Module):
    """Each rewrite finds its pattern: a constant affine after the first conv (``fold_affine``),
    whose channels differ 50x in range before a hard-swish read by a depthwise and a 1x1 conv
    (``split_ranges``), convs in a chain (``equalize``), a linear head reading a mean whose
    channels differ in range (``smoothquant``), and weights to round (``adaround``)."""

    def __init__(self, c: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.conv = nn.Conv2d(3, c, 1)
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.pw = nn.Conv2d(c, c, 1)
        self.mix = nn.Conv2d(c, c, 1)
        self.fc = nn.Linear(c, 6)
        with torch.no_grad():
            for m in (self.conv, self.dw, self.pw, self.mix, self.fc):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
            spread = torch.ones(c)
            spread[: c // 2] = 50.0
            self.conv.weight.mul_(spread.reshape(-1, 1, 1, 1))
            self.conv.bias.mul_(spread)
            self.pw.weight.div_(spread.reshape(1, -1, 1, 1))
            self.mix.weight.div_(spread.reshape(1, -1, 1, 1))
        self.eval()

    def forward(self, x):
        h = nn.functional.hardswish(self.conv(x) * 0.5 + 0.25)
        h = torch.relu(self.pw(self.dw(h)) + self.mix(h))
        return self.fc(h.mean((2, 3)))


def _data(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 10, 10, generator=g) for _ in range(n)]


OPTIONS = {
    "split_ranges": True,
    "equalize": True,
    "fold_affine": True,
    "smoothquant": 0.5,
    "adaround": qb.AdaRound(iterations=20, rows=256, batch_rows=64),  # few steps: fast
}


@pytest.fixture(scope="module")
def quantized():
    recipe = replace(qb.Recipe.preset("int8"), **OPTIONS)
    return qb.quantize(Everything(), _data(4, 1), recipe=recipe, progress=False)


def _export_bytes(model, x, path) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qb.export(model, path, example_inputs=x)
    return path.read_bytes()


def test_every_option_took_effect(quantized):
    # each option alone changes the int8 preset's model (measured: split 11 -> 16 quantizers,
    # fold_affine 11 -> 9, smoothed ["mean"]); together: the split and the smoothing recorded
    assert list(quantized.qb_capture["split_ranges"]) == ["conv2d"]
    assert quantized.qb_capture["smoothed"] == ["mean"]
    assert sum(type(m) is Quantizer for m in quantized.modules()) == 12


def test_qb_save_and_torch_save_give_the_same_model(quantized, tmp_path):
    qb.save(quantized, tmp_path / "m.qb")
    from_qb = qb.load(tmp_path / "m.qb", Everything())
    buffer = io.BytesIO()
    torch.save(quantized, buffer)
    buffer.seek(0)
    from_torch = torch.load(buffer, weights_only=False)
    x = _data(1, 3)[0]
    with torch.no_grad():
        expected = quantized(x)
        assert torch.equal(from_qb(x), expected)
        assert torch.equal(from_torch(x), expected)
    exported = _export_bytes(quantized, x, tmp_path / "q.onnx")
    assert _export_bytes(from_qb, x, tmp_path / "qb.onnx") == exported
    assert _export_bytes(from_torch, x, tmp_path / "torch.onnx") == exported
