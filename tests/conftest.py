"""Shared fixtures: quiet torch.onnx logging, small calibrated models reused across tests."""

from __future__ import annotations

import logging
import os

import pytest
import torch

logging.getLogger("torch.onnx").setLevel(logging.ERROR)

# No capture time limit in tests unless a test sets one: past the default 120 s (a PP-OCR export
# with every dimension dynamic on a loaded machine) the capture falls back to a dynamic batch,
# and a test of the dynamic image size would then fail by machine speed. The limit's own tests
# (tests/torch/test_capture_budget.py) set their budgets explicitly.
os.environ.setdefault("QB_CAPTURE_BUDGET_S", "none")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """In CI (``CI`` set), a parametrized test marked ``slow`` runs its first case only: every
    kind of end-to-end test still runs, and the suite keeps within CI's 30 minutes on two cores.
    ``QB_FULL_SUITE=1`` (and any run outside CI) runs every case."""
    if not os.environ.get("CI") or os.environ.get("QB_FULL_SUITE") == "1":
        return
    seen = set()
    skip = pytest.mark.skip(reason="CI runs the first case of a slow parametrized test")
    for item in items:
        if item.get_closest_marker("slow") is None or not hasattr(item, "callspec"):
            continue
        kind = item.nodeid.split("[", 1)[0]
        if kind in seen:
            item.add_marker(skip)
        seen.add(kind)
