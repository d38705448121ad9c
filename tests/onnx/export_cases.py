"""The zoo models both export-equivalence tests run: ``test_torch_onnx`` (the fast path against
torch's public path) and ``test_one_trace_export`` (the reused program against a new trace).

``CASES``: name -> (model builder, a batch of ``n`` samples)."""

from __future__ import annotations

import torch

from quantbridge.zoo import (
    DigitsCNN,
    TinyTransformer,
    TwoInputConcat,
    mobilenetv2_style,
    resnet18_style,
)


def image(n):
    return torch.randn(n, 3, 32, 32)


def two_inputs(n):
    return {"image": torch.randn(n, 3, 8, 8), "extra": torch.randn(n, 6), "scale": torch.rand(n, 1)}


CASES = {
    "resnet18_style": (lambda: resnet18_style(num_classes=10, width=8), image),
    "mobilenetv2_style": (lambda: mobilenetv2_style(num_classes=10, width=0.25), image),
    "tiny_transformer": (TinyTransformer, lambda n: torch.randint(0, 100, (n, 16))),
    "two_input_concat": (TwoInputConcat, two_inputs),
    "digits_cnn": (DigitsCNN, lambda n: torch.randn(n, 1, 8, 8)),
}
