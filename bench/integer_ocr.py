"""PP-OCRv4 detector, quantized by quantbridge (``quantize_onnx``, head included), lowered to an
integer-only program: text-mask IoU (probability > 0.3) of the program against ONNX Runtime on
the QDQ file, node by node and fused, with the program's op counts.

    python -m bench.integer_ocr [--recipe int8|native] [--size 160] [--work DIR]

The detector's final Sigmoid stays float in the QDQ file (nothing quantizes the probability
map), so the program is lowered with ``float_outputs="dequantize"``: it outputs the codes of the
last quantized tensor and the Sigmoid is a float table applied outside it. Calibration: 8
rendered text pages (``tests/onnx/ocr_data``), evaluation: 8 others, ``size`` x ``size``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

import quantbridge as qb
from bench.suite import engines

ROOT = Path(__file__).resolve().parents[1]


def _ort(path: Path, x: np.ndarray, optimize: bool) -> np.ndarray:
    session = engines.ort_session(path, optimize=optimize, threads=1)
    return session.run(None, {"x": x})[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="int8", help="quantize_onnx recipe (default int8)")
    parser.add_argument("--size", type=int, default=160)
    parser.add_argument("--work", help="keep the ONNX files here")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "onnx")]
    import ocr_data
    from ppocr_models import ppocr_dir, skip_reason

    if ppocr_dir() is None:
        raise SystemExit(skip_reason())
    det = ppocr_dir() / "ch_PP-OCRv4_det_infer.onnx"

    warnings.simplefilter("ignore")
    work = Path(args.work or tempfile.mkdtemp(prefix="qb_lower_ocr_"))
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"det.{args.recipe}.onnx"
    calib = {"x": ocr_data.pages(range(8), args.size, args.size)}
    qb.quantize_onnx(det, calib, path, recipe=args.recipe, progress=False, float_head=False)
    x = ocr_data.pages(range(1000, 1008), args.size, args.size)
    prog = qb.lower(path, input_shapes={"x": x.shape}, float_outputs="dequantize")
    t0 = time.perf_counter()
    (y,) = prog.run({"x": x}).values()
    result = {"model": f"PP-OCRv4 det, recipe {args.recipe}, 8 x 3 x {args.size} x {args.size}",
              "steps": prog.op_counts(), "executor_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    for optimize in (False, True):
        yo = _ort(path, x, optimize)
        a, b = y > 0.3, yo > 0.3
        key = "fused" if optimize else "node_by_node"
        result[f"mask_iou_ort_{key}"] = round(float((a & b).sum() / max((a | b).sum(), 1)), 4)
        result[f"probabilities_differing_{key}"] = round(float(np.mean(y != yo)), 4)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
