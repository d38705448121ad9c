"""Fixtures of the ONNX tests: export through the fast path (asserting it was taken) or through
torch's public ``torch.onnx.export`` path, the fast path's reference (``onnx/_torch_onnx``); the
PP-OCRv4 detector imported and quantized once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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


@pytest.fixture(scope="session")
def ppocr_det():
    """PP-OCRv4's detector imported with ``qb.import_onnx``, once per session (skipped where
    the model files are absent)."""
    from ppocr_models import ppocr_dir, skip_reason

    path = (ppocr_dir() or Path("/nonexistent")) / "ch_PP-OCRv4_det_infer.onnx"
    if not path.exists():
        pytest.skip(skip_reason())
    return qb.import_onnx(path)


@pytest.fixture(scope="session")
def ppocr_det_int8(ppocr_det, tmp_path_factory):
    """(QuantModel, path of its int8 QDQ file) of the detector quantized with the "native"
    recipe, dynamic batch, height and width, on four text images (seeds 20-23, 96 x 128), and
    exported with those dynamic sizes: one quantization and export of the detector for the
    tests of ``test_import.py`` and ``test_constant_operands.py`` that each made their own."""
    from test_import import _text_images

    calib = [torch.from_numpy(_text_images([20 + i], 96, 128)) for i in range(4)]
    qmodel = qb.quantize(ppocr_det, calib, dynamic="all", progress=False, recipe="native")
    path = tmp_path_factory.mktemp("det_int8") / "det.int8.onnx"
    qb.export(qmodel, path, example_inputs=calib[0])  # dynamic="all", as captured
    return qmodel, path
