"""``import_onnx`` of ONNX Runtime's INT8 PP-OCRv4 detector (QDQ, u8/s8, per tensor; slow).

Agreement with ORT running the same file with optimisations off (DequantizeLinear -> float op ->
QuantizeLinear node by node). The detector's SE blocks and FPN make step-wise agreement chaotic
(see ``test_import.py::test_det_int8_end_to_end``), so the criterion is the mean step difference
on the last quantized tensor the file writes, plus the text mask.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from ppocr_models import ppocr_dir, skip_reason

import quantbridge as qb

PPOCR = ppocr_dir() or Path(
    "missing"
)  # the rapidocr wheel's models, cached (tests/ppocr_models.py)
DET = PPOCR / "ch_PP-OCRv4_det_infer.onnx"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not DET.exists(), reason=skip_reason()),
    pytest.mark.skipif(os.environ.get("QB_SKIP_SLOW") == "1", reason="QB_SKIP_SLOW=1"),
]


def _images(seeds, height=96, width=128) -> np.ndarray:
    from test_import import _text_images  # the rendered-text pages of the float import tests

    return _text_images(seeds, height, width)


class _Reader(CalibrationDataReader):
    def __init__(self, batches):
        self._it = iter([{"x": b} for b in batches])

    def get_next(self):
        return next(self._it, None)


def _ort(path, x, optimize: bool) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )


def test_ort_int8_det_imports_and_agrees(tmp_path):
    logging.getLogger().setLevel(logging.ERROR)
    path = tmp_path / "det.qdq.onnx"
    calib = [_images([20 + i]) for i in range(3)]
    quantize_static(str(DET), str(path), _Reader(calib), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)  # fmt: skip
    model = onnx.load(str(path))
    x = _images([1000, 1001])
    convs = [n for n in model.graph.node if n.op_type == "Conv"]

    # the last quantized tensor: what the output Sigmoid reads through a DequantizeLinear; the
    # file is imported once, with that tensor as a second graph output (nothing else differs
    # from ORT's file, so one import checks both)
    last_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"][-1]
    model.graph.output.append(onnx.helper.make_tensor_value_info(last_dq.output[0], 1, None))
    extended = tmp_path / "det.qdq.inner.onnx"
    onnx.save(model, str(extended))
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    step = float(consts[last_dq.input[1]])
    again = qb.import_onnx(extended, example_inputs=torch.from_numpy(x))
    assert isinstance(again, qb.QuantModel)
    weights = [q for q in again.quantizers().values() if getattr(q, "kind", "") == "weight"]
    assert len(weights) >= len(convs)
    with torch.no_grad():
        y, inner = (t.numpy() for t in again(torch.from_numpy(x)))
    y_ref, inner_ref = _ort(extended, x, optimize=False)
    d = np.abs(inner - inner_ref) / step
    # measured (2 images, 96 x 128): mean 0.000 steps, 100% within 1 step, text-mask IoU 1.0;
    # bounds as in test_import.py's det test (the float summation order may flip a tie elsewhere)
    assert d.mean() <= 0.6 and (d <= 2.0 + 1e-3).mean() >= 0.97, (d.mean(), (d <= 2.001).mean())
    mask, mask_ref = y > 0.3, y_ref > 0.3
    assert (mask & mask_ref).sum() / max((mask | mask_ref).sum(), 1) >= 0.97
