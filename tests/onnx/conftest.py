"""Fixtures of the ONNX tests: export through the fast path (asserting it was taken) or through
torch's public ``torch.onnx.export`` path, the fast path's reference (``onnx/_torch_onnx``).
The PP-OCRv4 detector imported and quantized once per session: ``tests/conftest.py``."""

from __future__ import annotations

import pytest

import quantbridge as qb
from quantbridge.onnx.exporter import _torch_onnx


@pytest.fixture
def fast_export(monkeypatch):
    """``fast_export(qmodel, example, **to_onnx_kwargs)``: the ModelProto; fails unless the
    one-trace fast path produced it."""

    def export(qmodel, example, **kwargs):
        taken = []
        fast = _torch_onnx._fast
        with monkeypatch.context() as patch:
            patch.setattr(_torch_onnx, "_fast", lambda *a: taken.append(r := fast(*a)) or r)
            model = qb.onnx.to_onnx(qmodel, example, **kwargs)
        assert taken and taken[0] is not None, "the fast path was not taken"
        return model

    return export


@pytest.fixture
def public_export(monkeypatch):
    """``public_export(qmodel, example, **to_onnx_kwargs)``: the ModelProto of torch.onnx.export."""

    def export(qmodel, example, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(_torch_onnx, "FAST_PATH", False)
            return qb.onnx.to_onnx(qmodel, example, **kwargs)

    return export
