"""Shared fixtures: quiet torch.onnx logging, small calibrated models reused across tests, and
the PP-OCRv4 detector imported and quantized once per session (``tests/onnx`` and
``tests/integer`` both read it)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

logging.getLogger("torch.onnx").setLevel(logging.ERROR)

# No capture time limit in tests unless a test sets one: past the default 120 s (a PP-OCR export
# with every dimension dynamic on a loaded machine) the capture falls back to a dynamic batch,
# and a test of the dynamic image size would then fail by machine speed. The limit's own tests
# (tests/torch/test_capture_budget.py) set their budgets explicitly.
os.environ.setdefault("QB_CAPTURE_BUDGET_S", "none")
# compare's OpenVINO engine compiles in a child process first (a segfault becomes the engine's
# failure); ~1.5 s per compare, ~30 compares in the suite: off, except in its own test
# (tests/engine/test_openvino_crash.py), for the CI budget
os.environ.setdefault("QB_COMPARE_OPENVINO_CHILD", "0")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def ppocr_det():
    """PP-OCRv4's detector imported with ``qb.import_onnx``, once per session (skipped where
    the model files are absent). ``qb.quantize`` leaves it as it is; tests must not train or
    otherwise change it."""
    from ppocr_models import ppocr_dir, skip_reason

    import quantbridge as qb  # here, not at the top: tests/integer may put src/ on the path first

    path = (ppocr_dir() or Path("/nonexistent")) / "ch_PP-OCRv4_det_infer.onnx"
    if not path.exists():
        pytest.skip(skip_reason())
    return qb.import_onnx(path)


@pytest.fixture(scope="session")
def ppocr_det_int8(ppocr_det, tmp_path_factory):
    """(QuantModel, path of its int8 QDQ file) of the detector quantized with the "native"
    recipe, dynamic batch, height and width, on four text images (seeds 20-23, 96 x 128), and
    exported with those dynamic sizes: one quantization and export of the detector for the
    tests of ``onnx/test_import.py``, ``onnx/test_constant_operands.py`` and
    ``integer/test_integer_ocr.py`` that each made their own. Read-only: no test may change
    the QuantModel (train, calibrate, replace a layer) or the file."""
    onnx_tests = str(Path(__file__).resolve().parent / "onnx")
    if onnx_tests not in sys.path:  # a run of tests/integer alone
        sys.path.insert(0, onnx_tests)
    from test_import import _text_images

    import quantbridge as qb

    calib = [torch.from_numpy(_text_images([20 + i], 96, 128)) for i in range(4)]
    qmodel = qb.quantize(ppocr_det, calib, dynamic="all", progress=False, recipe="native")
    path = tmp_path_factory.mktemp("det_int8") / "det.int8.onnx"
    qb.export(qmodel, path, example_inputs=calib[0])  # dynamic="all", as captured
    return qmodel, path


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
