"""Integer-only program speed (issue 10): the numpy executor and the gcc -O3 C program against
ONNX Runtime on the same quantized ResNet-18-style model, single thread.

    python -m bench.integer_lower [--width 64] [--size 224] [--repeats 5] [--out results.json]

ONNX Runtime runs the QDQ file with its default graph optimizations, which fuse every
DQ -> Conv -> Q into QLinearConv (its QOperator kernels). Each engine is timed over ``repeats``
calls after one warm-up; the median is reported, and the ratios to ORT carry the claim (the
machine is shared). Threads: ORT intra_op 1, BLAS 1 (set before numpy loads), C single thread.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

import quantbridge as qb  # noqa: E402
from quantbridge.zoo import resnet18_style  # noqa: E402

C_MAIN = r"""#define _POSIX_C_SOURCE 199309L  /* clock_gettime in the harness only */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "qb_model.h"
static uint8_t in0[QB_IN0_SIZE]; static uint8_t out0[QB_OUT0_SIZE];
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
                          return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    int repeats = argc > 1 ? atoi(argv[1]) : 5;
    if (fread(in0, 1, sizeof in0, stdin) != sizeof in0) return 1;
    qb_run(in0, out0);
    for (int r = 0; r < repeats; r++) {
        double t0 = now(); qb_run(in0, out0); printf("%.6f\n", now() - t0);
    }
    fwrite(out0, 1, sizeof out0, stderr);
    return 0;
}
"""


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", help="keep the ONNX / C files here")
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(args.work or tempfile.mkdtemp(prefix="qb_lower_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    shape = (1, 3, args.size, args.size)

    model = resnet18_style(num_classes=1000, width=args.width)
    qm = qb.quantize(model, [torch.randn(*shape) for _ in range(4)], progress=False)
    path = work / "resnet18_style.int8.onnx"
    qb.export(qm, path, torch.randn(*shape))
    prog = qb.lower(path)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    ort_ms = _median_ms(lambda: sess.run(None, {"x": x}), args.repeats)
    numpy_ms = _median_ms(lambda: prog.run({"x": x}), args.repeats)

    cdir = work / "c"
    prog.emit_c(cdir, {"x": shape})
    (cdir / "main.c").write_text(C_MAIN)
    t0 = time.perf_counter()
    cmd = ["gcc", "-std=c99", "-O3", "-march=native", "-o", str(cdir / "run"),
           str(cdir / "main.c"), str(cdir / "qb_model.c")]  # fmt: skip
    subprocess.run(cmd, check=True)
    compile_s = time.perf_counter() - t0
    codes = prog.run_integer({"x": x})
    run = subprocess.run([str(cdir / "run"), str(args.repeats)], check=True, capture_output=True,
                         input=codes[prog.inputs[0].tensor.name].tobytes())  # fmt: skip
    c_ms = 1000 * statistics.median(float(t) for t in run.stdout.split())
    out = prog.outputs[0].tensor.name
    c_exact = bool(np.array_equal(np.frombuffer(run.stderr, np.uint8), codes[out].reshape(-1)))

    result = {
        "model": f"resnet18_style width {args.width}, 1x3x{args.size}x{args.size}, 1 thread",
        "ort_qdq_optimized_ms": round(ort_ms, 2),
        "numpy_executor_ms": round(numpy_ms, 2),
        "c_gcc_O3_ms": round(c_ms, 2),
        "numpy_over_ort": round(numpy_ms / ort_ms, 2),
        "c_over_ort": round(c_ms / ort_ms, 2),
        "c_compile_s": round(compile_s, 1),
        "c_bit_exact_with_numpy": c_exact,
        "steps": prog.op_counts(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
