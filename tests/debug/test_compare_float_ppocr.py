"""``qb.compare(float file, quantbridge's INT8 file)`` on PP-OCR's direction classifier
(``../shared/models/ppocr``, Paddle2ONNX): the float file spells squeeze-excite blocks as
GlobalAveragePool, Conv + Add(Reshape(bias)) and HardSigmoid, quantbridge's export of the
imported file as ReduceMean, Conv with bias and Mul -> Add -> Clip. Regression: pairing stopped at
the first GlobalAveragePool (8 of 151 sites paired with the float file's tensors)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from ppocr_models import ppocr_dir, skip_reason

import quantbridge as qb
from quantbridge.debug._match import find_sites

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "onnx"))
import ocr_data  # noqa: E402  (tests/onnx: the rendered lines of the OCR tests)

CLS = (ppocr_dir() or Path("missing")) / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
pytestmark = [
    pytest.mark.slow,  # 15-20 s here under load, almost all of it quantizing the classifier
    pytest.mark.skipif(os.environ.get("QB_SKIP_SLOW") == "1", reason="QB_SKIP_SLOW=1"),
    pytest.mark.skipif(not CLS.exists(), reason=skip_reason()),
    pytest.mark.skipif(ocr_data.missing() is not None, reason=str(ocr_data.missing())),
]


def _lines(first: int) -> np.ndarray:
    """4 upright and 4 upside-down rendered lines of 48 x 192 (the classifier's two classes)."""
    upright, _ = ocr_data.lines(range(first, first + 4), 192)
    flipped, _ = ocr_data.lines(range(first + 4, first + 8), 192, flip=True)
    return np.concatenate([upright, flipped])


def test_classifier_sites_pair_with_the_float_file():
    quantized = qb.quantize_onnx(CLS, {"x": _lines(0)}, progress=False)
    sites = find_sites(quantized)
    r = qb.compare(CLS, quantized, inputs={"x": _lines(1000)})
    assert r.errors == {}
    pairs = {t["name"]: p for t in r.tensors for p in t["pairs"] if "float_tensor" in p}
    # unpaired: only the Mul(x, 0.2) that starts each hard-sigmoid (no float value holds x / 5);
    # measured 142 of 151 paired, 9 HardSigmoid in the float file
    hard_sigmoids = sum(n.op_type == "HardSigmoid" for n in onnx.load(str(CLS)).graph.node)
    producer = {o: n for n in quantized.graph.node for o in n.output}
    unpaired = [s for s in sites if s.name not in pairs]
    assert len(unpaired) <= hard_sigmoids
    assert {producer[s.source].op_type for s in unpaired} <= {"Mul"}
    # each squeeze-excite block's ReduceMean and hard-sigmoid output pair across their region
    assert sum(p["matched_by"] == "region" for p in pairs.values()) >= 2 * hard_sigmoids
    # every paired tensor is the float tensor up to quantization noise: measured worst 15.0 dB,
    # median 19.3, on these lines; a wrong pair (another layer's output) is near 0 dB or below
    worst = min(pairs.values(), key=lambda p: p["sqnr_db"])
    assert worst["sqnr_db"] > 10, worst
