"""``quantbridge quantize`` on real files: the PP-OCRv4 models and onnx's model-zoo graphs.

PP-OCR (``../shared/models/ppocr``, Paddle2ONNX, opset 11/12), through the command line, with
rendered text (``ocr_data``; calibration and evaluation from separate seeds), the int8 file run
by ONNX Runtime's default (fused int8) session against the float file:

* detector: text-mask IoU (probability > 0.3) >= 0.97;
* recognizer: lines read exactly (greedy CTC) >= 91%;
* direction classifier: same label as float on >= 99% of lines (half of them upside down).

Model zoo (``onnx/backend/test/data/light``, opset 9): each file quantizes (opset 9 in, 18 out),
passes the checker and runs in ONNX Runtime with the float file's output shape; a graph with an
op the importer lacks fails naming it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import ocr_data
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import quantbridge as qb
from quantbridge.cli import main

# QB_PPOCR_DIR: the models' folder when the checkout is not next to ../shared (a git worktree)
PPOCR = Path(
    os.environ.get("QB_PPOCR_DIR")
    or (Path(__file__).resolve().parents[2] / ".." / "shared" / "models" / "ppocr").resolve()
)
DET = PPOCR / "ch_PP-OCRv4_det_infer.onnx"
REC = PPOCR / "ch_PP-OCRv4_rec_infer.onnx"
CLS = PPOCR / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
SLOW = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("QB_SKIP_SLOW") == "1", reason="QB_SKIP_SLOW=1"),
    pytest.mark.skipif(not DET.exists(), reason=f"PP-OCR models not found in {PPOCR}"),
    pytest.mark.skipif(ocr_data.missing() is not None, reason=str(ocr_data.missing())),
]


def _ort(path, feeds: dict) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _quantize(tmp_path: Path, model: Path, calib: np.ndarray, *extra: str) -> Path:
    np.savez(tmp_path / "calib.npz", x=calib)
    out = tmp_path / f"{model.stem}.int8.onnx"
    args = ["quantize", str(model), "--calib", str(tmp_path / "calib.npz"), "-o", str(out)]
    assert main([*args, "--quiet", *extra]) == 0
    return out


@pytest.mark.parametrize("_", [pytest.param(None, marks=SLOW)])
def test_detector_mask_iou(tmp_path, _):
    """8 calibration / 8 evaluation pages of 160 x 160; IoU of all text pixels together."""
    out = _quantize(tmp_path, DET, ocr_data.pages(range(8), 160, 160))
    x = ocr_data.pages(range(1000, 1008), 160, 160)
    expected, got = _ort(DET, {"x": x}) > 0.3, _ort(out, {"x": x}) > 0.3
    assert expected.mean() > 0.02  # the pages do hold text
    iou = (expected & got).sum() / (expected | got).sum()
    assert iou >= 0.97, f"text-mask IoU {iou:.4f}"


@pytest.mark.parametrize("_", [pytest.param(None, marks=SLOW)])
def test_recognizer_reads_lines(tmp_path, _):
    """32 calibration / 64 evaluation lines, 48 x 320."""
    calib, _texts = ocr_data.lines(range(32))
    out = _quantize(tmp_path, REC, calib)
    x, texts = ocr_data.lines(range(1000, 1064))
    chars = ocr_data.characters(REC)
    read = {
        name: np.mean(
            [
                a == b
                for a, b in zip(ocr_data.ctc_decode(_ort(p, {"x": x}), chars), texts, strict=True)
            ]
        )
        for name, p in (("float", REC), ("int8", out))
    }
    assert read["float"] >= 0.9, read  # the lines are readable
    assert read["int8"] >= 0.91, read


@pytest.mark.parametrize("_", [pytest.param(None, marks=SLOW)])
def test_classifier_same_label(tmp_path, _):
    """16 calibration / 128 evaluation lines of 48 x 192, half of each upside down."""
    upright, _t = ocr_data.lines(range(8), 192)
    flipped, _t = ocr_data.lines(range(8, 16), 192, flip=True)
    out = _quantize(tmp_path, CLS, np.concatenate([upright, flipped]))
    x = np.concatenate(
        [ocr_data.lines(range(2000, 2064), 192)[0], ocr_data.lines(range(3000, 3064), 192, True)[0]]
    )
    expected, got = _ort(CLS, {"x": x}).argmax(1), _ort(out, {"x": x}).argmax(1)
    assert (expected == np.repeat([0, 1], 64)).mean() >= 0.9  # float tells the directions apart
    assert (got == expected).mean() >= 0.99, f"{(got == expected).mean():.4f}"


# -- onnx model-zoo graphs -----------------------------------------------------------------------
FAST_LIGHT = {"light_squeezenet.onnx"}  # 41 s here under load; the others 3-20x that


def _light_params():
    names = sorted(p.name for p in LIGHT.glob("light_*.onnx"))
    return [n if n in FAST_LIGHT else pytest.param(n, marks=SLOW[:2]) for n in names]


@pytest.mark.parametrize("name", _light_params())
def test_model_zoo_graph_quantizes_and_runs(name, tmp_path):
    model = onnx.load(str(LIGHT / name))
    inits = {i.name for i in model.graph.initializer}
    (inp,) = [i for i in model.graph.input if i.name not in inits]
    shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    calib = {inp.name: rng.random([2, *shape[1:]], np.float32)}
    out = qb.quantize_onnx(model, calib, tmp_path / "q.onnx", progress=False, batch_size=shape[0])
    assert {o.domain: o.version for o in out.opset_import}[""] == 18
    x = rng.random(shape, np.float32)
    assert _ort(tmp_path / "q.onnx", {inp.name: x}).shape == _ort(LIGHT / name, {inp.name: x}).shape


def test_unsupported_op_is_named(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("TopK", ["x", "k"], ["v", "i"], name="pick")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 2])],
        [onnx.numpy_helper.from_array(np.array([2], np.int64), "k")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])
    with pytest.raises(ValueError, match="TopK"):
        qb.quantize_onnx(model, {"x": np.zeros((1, 8), np.float32)}, progress=False)
