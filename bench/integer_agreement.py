"""Integer program vs ONNX Runtime on quantbridge.zoo CNNs (issue 10 part 4), two recipes.

    python -m bench.integer_agreement

For resnet18_style (width 8) and mobilenetv2_style (width 0.35), 2x3x32x32 N(0,1) inputs,
recipes ``int8`` and ``int8_avx2`` (7-bit weights), against ORT with graph optimizations off
(the QDQ float path) and on (QLinearConv / QGemm / QLinearAdd kernels): layer-wise (every layer
fed the program's own codes, tests/integer/conftest.layerwise_lsb) the largest difference and
the fraction of codes that differ; end to end the fraction of outputs within 1 LSB.
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

import quantbridge as qb
from quantbridge.zoo import mobilenetv2_style, resnet18_style

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "resnet18_style": lambda: resnet18_style(num_classes=10, width=8),
    "mobilenetv2_style": lambda: mobilenetv2_style(num_classes=10, width=0.35),
}


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "integer"))
    from conftest import layerwise_lsb

    warnings.simplefilter("ignore")
    work = Path(tempfile.mkdtemp(prefix="qb_agreement_"))
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    for name, make in MODELS.items():
        for recipe in ("int8", "int8_avx2"):
            torch.manual_seed(0)
            calib = [torch.randn(4, 3, 32, 32) for _ in range(2)]
            qm = qb.quantize(make(), calib, recipe=recipe, progress=False)
            path = work / f"{name}_{recipe}.onnx"
            qb.export(qm, path, torch.randn(1, 3, 32, 32))
            prog = qb.lower(path)
            (y,) = prog.run({"x": x}).values()
            for optimize in (False, True):
                d = layerwise_lsb(onnx.load(path), prog, {"x": x}, optimize=optimize)
                worst = max(int(v.max()) for v in d.values())
                frac = sum(int((v > 0).sum()) for v in d.values()) / sum(v.size for v in d.values())
                so = ort.SessionOptions()
                so.intra_op_num_threads = 1
                if not optimize:
                    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
                sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
                e2e = np.abs(sess.run(None, {"x": x})[0] - y) / prog.outputs[0].tensor.scale
                print(f"{name} {recipe} ORT optimized={optimize}: layer-wise max {worst} LSB, "
                      f"{frac:.2e} of codes differ; end to end {np.mean(e2e <= 1.001):.3f} "
                      f"within 1 LSB (max {e2e.max():.0f})")  # fmt: skip


if __name__ == "__main__":
    main()
