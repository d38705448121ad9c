"""Every activation grid the presets write, in ONNX Runtime: which kernels it fuses, how fast, how
exact (issue 13 part 4: symmetric int8 activations after a ReLU are stored as uint8 with zero point
0 so that ORT fuses them).

    python -m bench.presets_speed                       # resnet18_style 1x3x112x112 and DigitsCNN
    python -m bench.presets_speed --rounds 50 --only resnet18

Per model and preset: the int8 / all Conv, Gemm, MatMul, Add kernels of ORT's optimized graph
(``bench.int8_coverage.census``), the float kernels left, the share of outputs within 1 LSB of
ORT's node-by-node run of the same file (checked before a time counts: a preset whose fused
kernels are wrong here is flagged, not timed as a win), and ms per call (1 thread) interleaved
with the float export: float/int8 median of the per-round ratios (> 1: int8 faster). Presets with
full-range 8-bit weights run with 7-bit weights where this CPU's int8 kernels saturate them
(``quantbridge.demo.exact_here``, as the demo does); the row says so.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

import quantbridge as qb
from bench.int8_coverage import census, optimized_session, timed
from bench.suite import engines
from quantbridge import zoo
from quantbridge.demo import exact_here

PRESETS = ("int8", "int8_symmetric", "pow2")
MODELS = {
    "resnet18": lambda: (zoo.resnet18_style(100, width=64).eval(), (1, 3, 112, 112)),
    "digits": lambda: (zoo.DigitsCNN().eval(), (1, 1, 8, 8)),
}


def _within_1_lsb(path: Path, feeds: dict, fused: list[np.ndarray], scale: float | None) -> float:
    ref = engines.ort_session(path, optimize=False).run(None, feeds)  # node by node: exact
    if scale is None:
        return float("nan")
    return float(np.mean(np.abs(ref[0] - fused[0]) <= scale * (1 + 1e-3)))


def _one_call(sess: ort.InferenceSession, feeds: dict) -> float:
    t = time.perf_counter()
    sess.run(None, feeds)
    return (time.perf_counter() - t) * 1e3


def measure(name: str, rounds: int, work: Path) -> dict:
    torch.manual_seed(0)
    model, shape = MODELS[name]()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(*shape, generator=g) for _ in range(4)]
    feeds_np = batches[0].numpy()
    float_path = work / f"{name}.float.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (batches[0],), str(float_path), input_names=["x"], dynamo=False)
    fsess, _ = optimized_session(float_path)
    rows = {}
    for preset in PRESETS:
        label, recipe = exact_here(preset, lambda _m: None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qm = qb.quantize(model, batches, recipe=recipe, progress=False)
            path = work / f"{name}.{preset}.onnx"
            qb.export(qm, path, batches[0])
        sess, kernels = optimized_session(path)
        feeds = {sess.get_inputs()[0].name: feeds_np}
        fused = sess.run(None, feeds)
        try:
            scale = float(qm.output_quantizer(0).scale.flatten()[0])
        except ValueError:  # a float output: no step to count in
            scale = None
        exact = _within_1_lsb(path, feeds, fused, scale)
        ffeeds = {fsess.get_inputs()[0].name: feeds_np}
        timed(fsess, ffeeds, 1), timed(sess, feeds, 1)  # warm-up (10 calls each)
        ratios, q_ms, f_ms = [], [], []
        for _ in range(rounds):  # interleaved: both sides see the same machine
            f = _one_call(fsess, ffeeds)
            q = _one_call(sess, feeds)
            ratios.append(f / q)
            q_ms.append(q)
            f_ms.append(f)
        rows[preset] = census(kernels) | {
            "label": label,
            "within_1_lsb": exact,
            "ms_int8": statistics.median(q_ms),
            "ms_float": statistics.median(f_ms),
            "float_over_int8": statistics.median(ratios),
        }
    return rows


def report(results: dict) -> str:
    lines = ["| model | preset (as run here) | int8 / all kernels | float kernels left | "
             "within 1 LSB of node-by-node | ms int8 / float (median) | float / int8 |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, rows in results.items():
        for r in rows.values():
            left = ", ".join(f"{op} {n}" for op, n in sorted(r["float_kernels"].items())) or "none"
            ok = r["within_1_lsb"]
            speed = f"{r['float_over_int8']:.2f}x" if ok >= 0.99 else "not counted (outputs off)"
            lines.append(f"| {name} | {r['label']} | {r['int8']}/{r['all']} | {left} | {ok:.2%} | "
                         f"{r['ms_int8']:.2f} / {r['ms_float']:.2f} | {speed} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.presets_speed")
    parser.add_argument("--only", default=",".join(MODELS), help="comma-separated models")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = {n: measure(n, args.rounds, Path(tmp)) for n in args.only.split(",")}
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
