"""Shared fixtures: quiet torch.onnx logging, small calibrated models reused across tests."""

from __future__ import annotations

import logging

import pytest
import torch

logging.getLogger("torch.onnx").setLevel(logging.ERROR)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
