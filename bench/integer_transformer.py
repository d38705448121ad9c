"""Integer program vs ONNX Runtime on ``zoo.EncoderStack`` (issue 10: integer softmax and layer
norm), two recipes.

    python -m bench.integer_transformer

Two encoder blocks (width 32, 4 heads, 8 tokens) and a per-token head, 64x8x32 N(0,1) inputs,
recipes ``int8`` and ``int8_avx2`` (7-bit weights), against ORT with graph optimizations off (float
softmax / layer norm on the QDQ semantics) and on (ORT's fused int8 kernels; full-range weights
saturate on CPUs without VNNI): layer-wise (every quantized tensor computed by ORT from the
program's own codes, tests/integer/conftest.layerwise_lsb) and at the block output (max LSB,
fraction exact, fraction within 1 LSB).
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
from quantbridge.zoo import EncoderStack

ROOT = Path(__file__).resolve().parents[1]


def _session(path: Path, optimize: bool) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _line(what: str, lsb: np.ndarray) -> str:
    return (f"{what}: {lsb.size} codes, max {int(lsb.max())} LSB, {(lsb == 0).mean():.2%} exact, "
            f"{(lsb <= 1).mean():.2%} within 1 LSB")  # fmt: skip


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "integer"))
    from conftest import layerwise_lsb

    warnings.simplefilter("ignore")
    work = Path(tempfile.mkdtemp(prefix="qb_transformer_"))
    x = np.random.default_rng(2).standard_normal((64, 8, 32)).astype(np.float32)
    for recipe in ("int8", "int8_avx2"):
        torch.manual_seed(0)
        data = [torch.randn(2, 8, 32) for _ in range(4)]
        qmodel = qb.quantize(EncoderStack().eval(), data, recipe=recipe, progress=False)
        path = work / f"encoder_{recipe}.onnx"
        qb.export(qmodel, path, example_inputs=data[0])
        prog = qb.lower(path)
        out = prog.outputs[0]
        got = prog.run({"x": x}, integer=True)[out.name].astype(np.int64)
        print(f"{recipe}: {prog}")
        for optimize in (False, True):
            name = "ORT optimized" if optimize else "ORT node by node"
            model = onnx.load(path)
            diffs = layerwise_lsb(model, prog, {"x": x}, optimize)
            every = np.concatenate([d.reshape(-1) for d in diffs.values()])
            print("  " + _line(f"{name}, layer-wise ({len(diffs)} tensors)", every))
            ref = _session(path, optimize).run(None, {"x": x})[0]
            codes = np.rint(ref / out.tensor.scale) + out.tensor.zero_point
            print("  " + _line(f"{name}, block output", np.abs(got - codes)))


if __name__ == "__main__":
    main()
