"""PP-OCRv4 detector, imported and quantized by quantbridge, lowered to an integer-only program:
text-mask IoU (probability > 0.3) of the program against ONNX Runtime on the QDQ model.

    python -m bench.integer_ocr [--work DIR]

The export leaves the detector's final Sigmoid in float (nothing quantizes the probability
map), so the script appends QuantizeLinear -> DequantizeLinear (uint8, scale 1/255) to the
output before lowering, and ORT runs the same appended file. Calibration: 8 rendered text
images (tests/onnx/test_import._text_images), evaluation: 8 others, 96x128.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper, numpy_helper

import quantbridge as qb

ROOT = Path(__file__).resolve().parents[1]
DET = ROOT / ".." / "shared" / "models" / "ppocr" / "ch_PP-OCRv4_det_infer.onnx"


def _with_output_quantized(path: Path, dst: Path) -> None:
    m = onnx.load(path)
    out = m.graph.output[0].name
    m.graph.initializer.extend([numpy_helper.from_array(np.float32(1 / 255), "p_scale"),
                                numpy_helper.from_array(np.uint8(0), "p_zero")])  # fmt: skip
    for n in m.graph.node:
        n.output[:] = [o + "_float" if o == out else o for o in n.output]
    m.graph.node.extend([
        helper.make_node("QuantizeLinear", [out + "_float", "p_scale", "p_zero"], [out + "_q"]),
        helper.make_node("DequantizeLinear", [out + "_q", "p_scale", "p_zero"], [out]),
    ])  # fmt: skip
    onnx.save(m, dst)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", help="keep the ONNX files here")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "onnx"))
    from test_import import _text_images

    warnings.simplefilter("ignore")
    work = Path(args.work or tempfile.mkdtemp(prefix="qb_lower_ocr_"))
    work.mkdir(parents=True, exist_ok=True)
    det = qb.import_onnx(DET)
    calib = torch.from_numpy(_text_images(list(range(8)), 96, 128))
    qm = qb.quantize(det, list(calib.split(2)), progress=False, recipe="native")
    qb.export(qm, work / "det.onnx", calib[:2])
    _with_output_quantized(work / "det.onnx", work / "det_q.onnx")
    prog = qb.lower(work / "det_q.onnx")
    print(prog)
    x = _text_images(list(range(8, 16)), 96, 128)
    (y,) = prog.run({"x": x}).values()
    for optimize in (False, True):
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        if not optimize:
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(
            str(work / "det_q.onnx"), so, providers=["CPUExecutionProvider"]
        )
        yo = sess.run(None, {"x": x})[0]
        a, b = y > 0.3, yo > 0.3
        iou = (a & b).sum() / max((a | b).sum(), 1)
        print(f"ORT (graph optimizations {'on' if optimize else 'off'}): mask IoU {iou:.4f}, "
              f"{np.mean(y != yo):.4f} of probabilities differ")  # fmt: skip


if __name__ == "__main__":
    main()
