"""Issue 12 bench: what fraction of the Conv / Gemm / MatMul / Add layers ONNX Runtime runs in
int8 on small replicas of the patterns real architectures write, and how fast.

    python -m bench.int8_coverage                        # every replica, coverage + ORT speed
    python -m bench.int8_coverage --only densenet,resnet18 --rounds 50

Each replica is quantized with ``recipe="native"`` and exported; ONNX Runtime optimizes it
(``ORT_ENABLE_ALL``, ``SessionOptions.optimized_model_filepath``) and the kernels of its graph are
sorted into families (``FAMILIES``): a QLinearConv is an int8 Conv, a FusedConv a float one, a
MatMulIntegerToFloat an int8 MatMul, and so on. The row gives int8 / all per family and in total,
and the float kernels left. Speed: ms per call, 1 thread, the median and the minimum of
``--rounds`` calls after 10 warm-up calls (the machine is shared: quote the minimum with care).

Replicas (``quantbridge.zoo``, random weights): ``resnet18`` - ResNet-18 with torchvision's
in-place BasicBlocks (``out += identity``), width 64, 1x3x112x112; ``densenet`` - DenseNet stem
and a 6-layer dense block (growth 32, pre-activation BN, concats after the ReLU-ended stem),
1x3x56x56; ``levit_bn1d`` - Linear + BatchNorm1d over flatten; ``repvgg`` - identity-branch BNs;
``gpt2`` - ``transformers.GPT2Model`` from a tiny config (Conv1D = addmm), when transformers is
installed. The attention matmuls of GPT-2 (``scaled_dot_product_attention``) are issue 12 part 8.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import onnxruntime as ort
import torch
from torch import nn

import quantbridge as qb
from bench.suite import engines
from quantbridge import zoo

# ORT kernel -> (family, runs in int8)
FAMILIES: dict[str, tuple[str, bool]] = {
    "QLinearConv": ("Conv", True), "ConvInteger": ("Conv", True),
    "Conv": ("Conv", False), "FusedConv": ("Conv", False), "NhwcFusedConv": ("Conv", False),
    "QGemm": ("Gemm", True), "Gemm": ("Gemm", False), "FusedGemm": ("Gemm", False),
    "QLinearMatMul": ("MatMul", True), "MatMulIntegerToFloat": ("MatMul", True),
    "MatMulInteger": ("MatMul", True), "DynamicQuantizeMatMul": ("MatMul", True),
    "MatMul": ("MatMul", False), "FusedMatMul": ("MatMul", False),
    "QLinearAdd": ("Add", True), "Add": ("Add", False),
    "BatchNormalization": ("BatchNormalization", False),
}  # fmt: skip


def _images(shape):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g) for _ in range(3)]


def _gpt2():
    g = torch.Generator().manual_seed(2)  # ImportError without transformers: the row is skipped
    return zoo.tiny_gpt2(), [torch.randint(0, 200, (1, 16), generator=g) for _ in range(3)]


def _seeded(build):
    torch.manual_seed(0)
    return zoo._randomize_bn(build()).eval()


REPLICAS = {
    "resnet18": lambda: (zoo.resnet18_inplace(100), _images((1, 3, 112, 112))),
    "densenet": lambda: (_seeded(lambda: zoo.DenseBlockNet(64, 32, 6)), _images((1, 3, 56, 56))),
    "levit_bn1d": lambda: (_seeded(lambda: zoo.LinearBN1d(64)), _images((1, 49, 64))),
    "repvgg": lambda: (
        _seeded(
            lambda: nn.Sequential(
                nn.Conv2d(3, 32, 3, 2, 1), nn.ReLU(), *[zoo.RepVGGBlock(32) for _ in range(3)]
            )
        ),  # fmt: skip
        _images((1, 3, 56, 56)),
    ),
    "gpt2": _gpt2,
}


def measure(name: str, rounds: int, work: Path) -> dict:
    model, batches = REPLICAS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = qb.quantize(model, batches, recipe="native", progress=False)
        qb.export(qm, work / f"{name}.onnx", batches[0])
    sess, kernels = optimized_session(work / f"{name}.onnx")
    return census(kernels) | timed(sess, {sess.get_inputs()[0].name: batches[0].numpy()}, rounds)


def optimized_session(path: Path) -> tuple[ort.InferenceSession, collections.Counter]:
    """The suite's ORT session (all optimizations) on 1 thread on ``path``, and the kernel
    counts of its optimized graph."""
    optimized = path.with_suffix(".ort.onnx")
    sess = engines.ort_session(path, optimized_path=optimized, threads=1)
    return sess, engines.kernel_counts(optimized)


def census(kernels: collections.Counter) -> dict:
    """int8 / all kernels per family (``FAMILIES``) and the float kernels left."""
    counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # family -> int8, all
    for op, n in kernels.items():
        if op in FAMILIES:
            family, int8 = FAMILIES[op]
            counts[family][0] += n * int8
            counts[family][1] += n
    return {
        "families": dict(counts),
        "int8": sum(c[0] for c in counts.values()),
        "all": sum(c[1] for c in counts.values()),
        "float_kernels": {
            op: n for op, n in kernels.items() if op in FAMILIES and not FAMILIES[op][1]
        },
    }


def timed(sess: ort.InferenceSession, feeds: dict, rounds: int) -> dict:
    """Median and minimum ms per call over ``rounds`` calls after 10 warm-up calls."""
    for _ in range(10):
        sess.run(None, feeds)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - t) * 1e3)
    return {"ms_median": statistics.median(times), "ms_min": min(times), "times": times}


def report(results: dict) -> str:
    lines = ["| replica | int8 / all (Conv, Gemm, MatMul, Add, BN) | per family | float kernels left | ORT ms (median, min) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | unavailable: {r['error']} | | | |")
            continue
        fam = ", ".join(f"{f} {a}/{b}" for f, (a, b) in sorted(r["families"].items()))
        left = ", ".join(f"{op} {n}" for op, n in sorted(r["float_kernels"].items())) or "none"
        lines.append(f"| {name} | {r['int8']}/{r['all']} ({r['int8'] / max(r['all'], 1):.0%}) | "
                     f"{fam} | {left} | {r['ms_median']:.2f}, {r['ms_min']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.int8_coverage")
    parser.add_argument("--only", default=",".join(REPLICAS), help="comma-separated replicas")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write the raw numbers here")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            try:
                results[name] = measure(name, args.rounds, Path(tmp))
            except ImportError as e:  # an optional peer (transformers) missing
                results[name] = {"error": f"{type(e).__name__}: {e}"}
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
