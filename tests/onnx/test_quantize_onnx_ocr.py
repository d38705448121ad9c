"""``quantbridge quantize`` on real files: the PP-OCRv4 models and onnx's model-zoo graphs.

PP-OCR (``../shared/models/ppocr``, Paddle2ONNX, opset 11/12), through the command line, with
rendered text (``ocr_data``; calibration and evaluation from separate seeds), the int8 file run
by ONNX Runtime node by node and fused (see ``_ort``) against the float file:

* detector: text-mask IoU (probability > 0.3); target 0.97, measured 0.943-0.948 (not met);
* recognizer: lines read exactly (greedy CTC); target 91%, met with ``--method percentile
  --recipe int8_avx2``: 92.6% / 93.8% fused on 256 lines (mse 90.2% / 89.5%; see the test);
* direction classifier: same label as float (half of the lines upside down); target 99%,
  measured 99.2% node by node and fused with ``--method mse --recipe int8_avx2`` (met).

Model zoo (``onnx/backend/test/data/light``, opset 9): each file quantizes (opset 9 in, 18 out),
passes the checker and runs in ONNX Runtime with the float file's output shape; a graph with an
op the importer lacks fails naming it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import ocr_data
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from ppocr_models import ppocr_dir, skip_reason

import quantbridge as qb
from quantbridge.cli import main

# the PP-OCR models the way a user gets them: the rapidocr wheel, cached (tests/ppocr_models.py)
PPOCR = ppocr_dir() or Path("missing")
DET = PPOCR / "ch_PP-OCRv4_det_infer.onnx"
REC = PPOCR / "ch_PP-OCRv4_rec_infer.onnx"
CLS = PPOCR / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
SLOW = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("QB_SKIP_SLOW") == "1", reason="QB_SKIP_SLOW=1"),
    pytest.mark.skipif(not DET.exists(), reason=skip_reason()),
    pytest.mark.skipif(ocr_data.missing() is not None, reason=str(ocr_data.missing())),
]


def _ort(path, feeds: dict, optimize: bool = True) -> np.ndarray:
    """The first output of a CPU session; ``optimize=False`` runs the QDQ file node by node (the
    file's own arithmetic), the default fuses int8 kernels. ONNX Runtime's fused u8 x s8 kernels
    saturate 16-bit pair sums on AVX2 CPUs without VNNI (this machine: AMD EPYC, avx2, no vnni),
    a known engine limitation that the node-by-node figure does not have."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _quantize(tmp_path: Path, model: Path, calib: np.ndarray, *extra: str) -> Path:
    np.savez(tmp_path / "calib.npz", x=calib)
    out = tmp_path / f"{model.stem}.int8.onnx"
    args = ["quantize", str(model), "--calib", str(tmp_path / "calib.npz"), "-o", str(out)]
    pin = [] if "--recipe" in extra else ["--recipe", "int8"]  # as measured (the old default)
    assert main([*args, "--quiet", *pin, *extra]) == 0
    return out


@pytest.mark.parametrize("_", [pytest.param(None, marks=SLOW)])
def test_detector_mask_iou(tmp_path, _):
    """8 calibration / 8 evaluation pages of 160 x 160; IoU of all text pixels together.

    Target 0.97 met since stop 13 with the setting at the end of this docstring. History: int8
    0.948 node by node, 0.943 fused (minmax, float head); 7-bit
    weights 0.948 / 0.948. Other general settings (stop 10, node by node / fused, IoU and SQNR):
    --method mse 0.947 / 0.943, 14.04 / 13.77 dB; --method mse --recipe int8_avx2 0.952 / 0.953,
    14.71 / 14.76 dB (the best); bias correction 0.939 / 0.932, 13.66 / 13.21 dB; --method
    percentile 0.944 / 0.938, 13.67 / 13.16 dB; the head's first two layers float as well: 0.952 /
    0.953. Where the loss is (torch fake quant, int8 minmax, 0.948 / 14.52 dB as in ONNX Runtime;
    quantizers switched off after calibration): the first 32 of 260 quantized layers and ops (the
    backbone's stem) kept float give 0.975 / 19.27 dB, any other eighth of the graph kept float
    <= 0.953; quantized alone, the stem's p2o.Conv.2 and the scalar affine after it
    (PP-LCNetV3's learnable affine block: p2o.Mul.6, p2o.Add.10) each cost most (18.7-19.3 dB):
    their activation grids (steps 0.41 and 0.78: a range of ~100-200 that outlier channels set),
    not the weights (30.8 dB) or the constants (46.7 dB).
    Folding the constant affine blocks into their convs (``Recipe(fold_affine=True)``, off by
    default, 96 ops; same load, stop 11, node by node / fused): with mse + int8_avx2 0.952 /
    0.953, 14.71 / 14.76 dB -> 0.966 / 0.966, 16.90 / 16.85 dB (output side only: 0.961 / 0.962,
    16.20 / 16.23), ORT fused 0.81x the time; int8 minmax (output side only) 0.946 / 0.947, 14.33 /
    14.40 dB; the "default" preset 0.934 / 0.934, 13.21 / 13.25 dB -> 0.932 / 0.931, 12.98 /
    12.93 dB. Off because it costs the recognizer (see there). int16 activations on the first 12
    ONNX nodes (to p2o.Conv.2; recipe rules as ``quantbridge sensitivity`` writes with
    ``wider="int16"``) on top of the fold and mse + int8_avx2: 0.975 / 0.975, 18.91 / 19.16 dB
    (IoU target met), ORT fused 1.24x the int8 file's time (as slow as float on this CPU).
    ``Recipe(reader_bounds=True)`` (off by default; values only a hard-swish reads calibrated on
    [-3, max], ``torch._reader_ranges``; stop 13, quantize_onnx, load 8-16): int8 0.962 / 0.954,
    16.36 / 15.26 dB; the "default" preset 0.952 / 0.952, 14.94 / 14.97 dB; no change with mse.
    Off because the recognizer reads 47% instead of 80% of its 64 lines with it (default preset).
    Stop 13 (lead): the default preset with ``bias_correction: sequential`` (layer by layer on
    the quantized network's own inputs) and ``fold_affine: true``, ``--method mse`` (what this test
    runs): 0.9736 / 0.9725, 18.57 / 18.29 dB, all 62 convs QLinearConv in the fused session: the
    IoU target is met with every conv int8 (the default preset alone 0.934 / 13.21 dB; + sequential
    0.970 / 0.971, 17.82 / 17.84; + sequential + reader_bounds 0.967, 17.06; + sequential + mse
    0.967, 17.15; ``/tmp/s7det/ortdet.py``, quantize_onnx, one thread). SQNR target 20 dB not met."""
    recipe = dataclasses.replace(
        qb.Recipe.preset("default"), bias_correction="sequential", fold_affine=True
    )
    (tmp_path / "recipe.yaml").write_text(recipe.to_yaml())
    out = _quantize(
        tmp_path,
        DET,
        ocr_data.pages(range(8), 160, 160),
        *("--recipe", str(tmp_path / "recipe.yaml"), "--method", "mse"),
    )
    x = ocr_data.pages(range(1000, 1008), 160, 160)
    expected = _ort(DET, {"x": x}) > 0.3
    assert expected.mean() > 0.02  # the pages do hold text
    probability = _ort(DET, {"x": x}).astype(np.float64)
    for optimize in (False, True):
        y = _ort(out, {"x": x}, optimize)
        got = y > 0.3
        iou = (expected & got).sum() / (expected | got).sum()
        # issue 9's target itself (measured 0.9736 / 0.9725 node by node / fused)
        assert iou >= 0.97, f"text-mask IoU {iou:.4f} (optimize={optimize})"
        # SQNR of the probability map: target 20 dB NOT met, measured 18.57 / 18.29 dB
        sqnr = 10 * np.log10((probability**2).sum() / ((probability - y) ** 2).sum())
        assert sqnr >= 17.5, f"SQNR {sqnr:.2f} dB (optimize={optimize})"
    # every conv still runs as an int8 kernel in the fused session
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "fused.onnx")
    ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    fused = [n.op_type for n in onnx.load(tmp_path / "fused.onnx").graph.node]
    n_conv = sum(n.op_type == "Conv" for n in onnx.load(DET).graph.node)
    assert fused.count("QLinearConv") == n_conv and "Conv" not in fused


@pytest.mark.parametrize("_", [pytest.param(None, marks=SLOW)])
def test_recognizer_reads_lines(tmp_path, _):
    """32 calibration / 64 evaluation lines, 48 x 320; float reads all 64.

    Target 91% (issue 9) met with percentile calibration of the activations (99.99, the
    observer's default) and 7-bit weights (``--method percentile --recipe int8_avx2``, stop 13):
    on 256 lines (seeds 1000-1255) 92.6% node by node, 93.8% fused; on these 64 lines 93.8% /
    96.9% (60 / 62). Same tree, same lines: ``--method mse`` 90.2% / 89.5% on 256
    (95.3% / 96.9% on 64), ``--method entropy`` 0% (its KL ranges clip the stem's outputs to a
    quarter of mse's: ``conv2d`` step 0.038 vs 0.159). Not the default preset: its bias
    correction costs this model 14 points (percentile, 256 lines: default 78.5% / 78.9%, default
    without bias correction 92.6% / 93.8%, int8_avx2 with it 78.5% / 78.9%; it moves some
    channels of the last pointwise convs by up to 28 output steps, ``conv2d_32``).
    Earlier (mse): 90.6% node by node, 93.8% fused on 64 lines (stop 10).
    Stop 8's 98.4% / 96.9% was no better model, only a lucky 64-line sample: its file and this
    tree's differ in the 10 quantizers of the layer norms' variance only (kept float since the
    Div-divisor rule) and in scales in the 4th digit, and on 256 lines (seeds 1000-1255) both
    read the same: stop 8 90.6% / 89.5% fused, this tree 90.2% / 89.5% (captured with
    dynamic='batch' and with dynamic='all' alike), while on the first 64 lines stop 8 read 63
    and reruns of this tree 58 (stop 10) and 61. These 64 lines move by 3-5 lines with 4th-digit
    changes of the scales; the mse file's level is ~90%, just under the target.
    With the default minmax: 82.8% (int8 and int8_avx2 alike; the misreads are mostly spaces
    between words dropped), 84.4% / 79.7% with bias correction, 51.6% with percentile.
    ``Recipe(fold_affine=True)`` (its conv -> * s -> + t blocks folded; stop 11, same tree, mse +
    int8_avx2, output side only) reads 84.4% / 84.4% here (61/64 and 62/64 without) and 79.7% /
    80.9% on 256 lines (90.2% / 89.5% without), though every remaining grid equals the unfolded
    file's (activations to the 4th digit, weight codes identical, weight scales times k) and
    the float function is unchanged (1.1e-4 max on the softmax). Stop 13 reproduced that loss
    without folding: removing from the unfolded mse file the 75 Q/DQ pairs the output-side fold
    removes (conv outputs read by the affine ``* k``, and its products), all else identical,
    reads 85.9% of 128 lines (92.2% with them), and 85.9% again with each pair replaced by a
    Clip to its range (so the rounding, not the clipping); removing the hard-swish product and
    quotient pairs instead (61): 83.6%. Yet the output SQNR against float (32 lines) is 12.22 dB
    with all pairs, 12.43 dB without the fold's 75: fewer roundings, a slightly better output,
    fewer whole lines right. Lines read moves by 5-8 of 128 with such changes; so does a
    ``constant_chains`` placement tried in stop 13 (one quantizer after ``x * g / 6 * a + b``
    instead of four: 88.3% / 87.9% on 256 lines, not landed). Activations all float (7-bit
    weights only): 96.9% of 256. Bound: the measured level less 3 lines, the spread this
    sample shows with 4th-digit scale changes (57/64 = 0.89), so that a real regression fails
    it. Issue 9's target (91%) on this sample: 59/64 = 92.2% (stop 13: 60/64 node by node,
    62/64 fused; 92.6% / 93.8% of 256 lines), asserted; the float model reads 99.22% of 256."""
    calib, _texts = ocr_data.lines(range(32))
    out = _quantize(tmp_path, REC, calib, "--method", "percentile", "--recipe", "int8_avx2")
    x, texts = ocr_data.lines(range(1000, 1064))
    chars = ocr_data.characters(REC)

    def read(path, optimize: bool = True) -> float:
        lines = ocr_data.ctc_decode(_ort(path, {"x": x}, optimize), chars)
        return float(np.mean([a == b for a, b in zip(lines, texts, strict=True)]))

    assert read(REC) >= 0.9  # the lines are readable
    for optimize in (False, True):
        lines_read = read(out, optimize)
        assert lines_read >= 59 / 64, f"{lines_read:.4f} of 64 lines (optimize={optimize})"


@pytest.mark.parametrize("_", [pytest.param(None, marks=SLOW)])
def test_classifier_same_label(tmp_path, _):
    """16 calibration / 128 evaluation lines of 48 x 192, half of each upside down.

    Same label as float, with ``--method mse --recipe int8_avx2``: measured 99.2% node by node
    and fused (target 99% met both ways). With the default (minmax, int8): 99.2% node by node,
    93.75% fused on this AVX2-without-VNNI CPU (saturation, see ``_ort``). Bounds: 98% (one line
    of margin for float summation order on other CPUs)."""
    upright, _t = ocr_data.lines(range(8), 192)
    flipped, _t = ocr_data.lines(range(8, 16), 192, flip=True)
    calib = np.concatenate([upright, flipped])
    out = _quantize(tmp_path, CLS, calib, "--method", "mse", "--recipe", "int8_avx2")
    x = np.concatenate(
        [ocr_data.lines(range(2000, 2064), 192)[0], ocr_data.lines(range(3000, 3064), 192, True)[0]]
    )
    expected = _ort(CLS, {"x": x}).argmax(1)
    assert (expected == np.repeat([0, 1], 64)).mean() >= 0.9  # float tells the directions apart
    same = (_ort(out, {"x": x}, optimize=False).argmax(1) == expected).mean()
    assert same >= 0.98, f"node by node {same:.4f}"
    same = (_ort(out, {"x": x}).argmax(1) == expected).mean()
    assert same >= 0.98, f"fused {same:.4f}"


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
    out = qb.quantize_onnx(
        model, calib, tmp_path / "q.onnx", progress=False, batch_size=shape[0], recipe="int8"
    )
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
        qb.quantize_onnx(model, {"x": np.zeros((1, 8), np.float32)}, progress=False, recipe="int8")
