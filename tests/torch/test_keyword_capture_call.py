"""A model quantized from dict batches is captured with its inputs in the dict's order; called
with positional inputs, its graph took them in that order, not ``forward``'s. Found by a
newcomer walk: ``{"b": b, "a": a}`` then ``qmodel(a, b)`` failed with torch's
``Guard failed: b.size()[1] == 2``, and with equal shapes it would have swapped the inputs
silently. Now a TypeError says to call it with keywords; the positional call still works where
the dict's order is ``forward``'s."""

from __future__ import annotations

import warnings

import pytest
import torch

import quantbridge as qb


class _TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, a, b):
        return self.fc(a) + b


def _quantized(batch: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-VNNI advice; not what this test is about
        return qb.quantize(_TwoInputs().eval(), [batch], progress=False)


def test_positional_call_of_a_model_captured_from_keywords_in_another_order(tmp_path):
    a, b = torch.randn(3, 4), torch.randn(3, 2)
    qmodel = _quantized({"b": b, "a": a})
    with pytest.raises(TypeError, match=r"order \['b', 'a'\].*model\(\*\*batch\)"):
        qmodel(a, b)
    with pytest.raises(TypeError, match=r"order \['b', 'a'\]"):
        qb.export(qmodel, tmp_path / "m.onnx", example_inputs=(a, b))
    assert torch.equal(qmodel(b=b, a=a), qmodel(a=a, b=b))


def test_positional_call_in_forwards_order_still_works():
    a, b = torch.randn(3, 4), torch.randn(3, 2)
    qmodel = _quantized({"a": a, "b": b})
    assert torch.equal(qmodel(a, b), qmodel(a=a, b=b))
