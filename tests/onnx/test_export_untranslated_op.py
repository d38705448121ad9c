"""``qb.export`` of a model calling an op torch's ONNX translator does not know (a library's
custom op: transformers' ``grouped_mm_fallback`` in every Hugging Face mixture-of-experts model,
transformers 5) names the op, the layer and the fix, instead of torch's ConversionError page."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantbridge as qb


@torch.library.custom_op("qbtest::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


class _Experts(nn.Module):
    def forward(self, x):
        return torch.ops.qbtest.twice(x)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.experts = nn.Linear(4, 4), _Experts()

    def forward(self, x):
        return self.experts(self.fc(x))


def test_an_op_without_onnx_translation_is_named_with_its_layer(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    qm = qb.quantize(_Model().eval(), [x], progress=False)
    with pytest.raises(ValueError, match=r"the op qbtest\.twice \(in experts\) has no ONNX "
                       r"translation in torch\.onnx; write that computation"):  # fmt: skip
        qb.export(qm, tmp_path / "m.onnx", x)
