"""Fixtures of the debug-layer tests: a small residual CNN quantized with the 'native' recipe
(7-bit weights on AVX2 CPUs without VNNI, so ORT's fused u8s8 kernels cannot saturate) and
exported to QDQ once per session. The models themselves live in ``debug_models.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from debug_models import ResidualCNN

import quantbridge as qb


@pytest.fixture(scope="session")
def cnn(tmp_path_factory):
    """(QDQ path, QuantModel, inputs dict) of the residual CNN."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    calib = [torch.from_numpy(rng.standard_normal((8, 3, 8, 8)).astype(np.float32))]
    qmodel = qb.quantize(ResidualCNN().eval(), calib, recipe="native")
    path = tmp_path_factory.mktemp("debug") / "cnn.int8.onnx"
    qb.export(qmodel, path, example_inputs=calib[0])
    inputs = {"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32)}
    return path, qmodel, inputs
