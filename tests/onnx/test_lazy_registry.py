"""The export fast path's registry (``onnx/exporter/_lazy_registry``) against torch's own
``ONNXRegistry.from_torchlib``: for every operator torch's registry holds, the same functions in
the same order (custom translations first), and nothing for an operator it does not hold."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.onnx._internal.exporter import _registration

import quantbridge as qb
from quantbridge.onnx.exporter import _torch_onnx
from quantbridge.onnx.exporter._lazy_registry import lazy_registry
from quantbridge.onnx.exporter._translate import translation_table
from quantbridge.zoo import resnet18_style


def _entries(decomps):
    return [(id(d.onnx_function), d.is_complex, d.opset_introduced, d.is_custom) for d in decomps]


@pytest.mark.parametrize("opset", [18, 21])
def test_same_entries_as_from_torchlib(opset):
    full = _registration.ONNXRegistry.from_torchlib(opset_version=opset)
    lazy = lazy_registry(opset)
    table = translation_table(opset)
    for registry in (full, lazy):
        for op, fn in table.items():
            registry.register_op(op, fn, is_complex=False)
    keys = list(full.functions)
    assert len(keys) > 500  # torchlib's whole table
    for key in keys:
        target = _registration._get_overload(key) if isinstance(key, str) else key
        if target is None:  # our custom ops are keyed by name too
            target = next(op for op in table if op.name() == key)
        assert _entries(lazy.get_decomps(target)) == _entries(full.get_decomps(target)), key
    # an operator torch's registry does not hold: nothing in the lazy one either
    missing = torch.ops.aten.native_channel_shuffle.default
    assert missing.name() not in full.functions and lazy.get_decomps(missing) == []
    assert lazy.is_registered(operator.getitem) and full.is_registered(operator.getitem)


def test_export_is_byte_identical_to_the_from_torchlib_registry(monkeypatch, tmp_path):
    """The whole fast-path export with torch's own registry in place of the lazy one: the same
    file, byte for byte (ResNet-18-style: conv, BN folded, add, relu, mean, linear, Q/DQ)."""
    torch.manual_seed(0)
    model = resnet18_style().eval()
    x = torch.randn(2, 3, 32, 32)
    qmodel = qb.quantize(model, [x], "native", progress=False)
    qb.export(qmodel, tmp_path / "lazy.onnx", example_inputs=x[:1])

    def from_torchlib(opset):
        registry = _registration.ONNXRegistry.from_torchlib(opset_version=max(opset, 18))
        for op, fn in translation_table(opset).items():
            registry.register_op(op, fn, is_complex=False)
        return registry

    monkeypatch.setattr(_torch_onnx, "_registry", from_torchlib)
    qb.export(qmodel, tmp_path / "full.onnx", example_inputs=x[:1])
    lazy, full = (tmp_path / "lazy.onnx").read_bytes(), (tmp_path / "full.onnx").read_bytes()
    assert len(lazy) > 10_000 and lazy == full
