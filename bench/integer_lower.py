"""Integer-only program speed (issue 10): the numpy executor and the gcc -O3 C program against
ONNX Runtime on the same quantized ResNet-18-style model, single thread.

    python -m bench.integer_lower [--width 64] [--size 224] [--repeats 5] [--rounds 3]
                                  [--cflags gcc_O3 gcc_O3_x86_clones gcc_O3_march_native]
                                  [--out results.json]

ONNX Runtime runs the QDQ file with its default graph optimizations, which fuse every
DQ -> Conv -> Q into QLinearConv (its QOperator kernels). The C program is built three times:
plain ``-O3`` (portable C99: SSE2 vectors on x86-64), ``-O3 -DQB_X86_CLONES`` (gcc on x86-64
Linux: the conv steps also built for AVX2 and picked at load time; the binary still runs on any
x86-64) and ``-O3 -march=native`` (AVX2 here; the binary only runs on CPUs like this one). Every engine is timed for ``repeats``
calls after one warm-up, once per round; the median over all calls is reported with min / max,
and the ratios to ORT (overall and per round) carry the claim, since the machine is shared.
Threads: ORT intra_op 1, BLAS 1 (set before numpy loads), C single thread.
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


# The portable build (what any C99 compiler target gets) and one tuned to this CPU (AVX2 here)
CFLAGS = {
    "gcc_O3": ["-O3"],
    "gcc_O3_x86_clones": ["-O3", "-DQB_X86_CLONES"],  # still any x86-64: AVX2 picked at load time
    "gcc_O3_march_native": ["-O3", "-march=native"],
}


def _compile(cdir: Path, flags: list[str]) -> tuple[Path, float]:
    """gcc ``flags`` -> (executable, seconds to compile)."""
    exe = cdir / ("run" + "".join(flags).replace("-", "_").replace("=", "_"))
    t0 = time.perf_counter()
    subprocess.run(["gcc", "-std=c99", *flags, "-o", str(exe), str(cdir / "main.c"),
                    str(cdir / "qb_model.c")], check=True)  # fmt: skip
    return exe, time.perf_counter() - t0


def _times_ms(fn, repeats: int) -> list[float]:
    """``repeats`` timed calls of ``fn`` after one warm-up call, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return times


def _c_times_ms(exe: Path, codes: bytes, repeats: int) -> tuple[list[float], bytes]:
    """The C program's own timings of ``repeats`` calls (after one warm-up), and its output."""
    run = subprocess.run([str(exe), str(repeats)], check=True, capture_output=True, input=codes)
    return [1000 * float(t) for t in run.stdout.split()], run.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="time every engine once per round, `repeats` calls each",
    )
    parser.add_argument(
        "--cflags",
        nargs="+",
        choices=sorted(CFLAGS),
        default=list(CFLAGS),
        help="C builds to time (default: all)",
    )
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
    cdir = work / "c"
    prog.emit_c(cdir, {"x": shape})
    (cdir / "main.c").write_text(C_MAIN)
    codes = prog.run_integer({"x": x})
    in_codes = codes[prog.inputs[0].tensor.name].tobytes()
    out_codes = codes[prog.outputs[0].tensor.name].reshape(-1)
    builds = {name: _compile(cdir, CFLAGS[name]) for name in args.cflags}

    # Every engine once per round, rounds repeated: a burst of load on the shared machine hits
    # all engines alike, and each round gives one ratio (their spread is reported).
    times = {"ort": [], "numpy": [], **{name: [] for name in builds}}
    ratios = {name: [] for name in times if name != "ort"}
    c_exact = dict.fromkeys(builds, True)
    for _ in range(args.rounds):
        t = {"ort": _times_ms(lambda: sess.run(None, {"x": x}), args.repeats),
             "numpy": _times_ms(lambda: prog.run({"x": x}), args.repeats)}  # fmt: skip
        for name, (exe, _) in builds.items():
            t[name], out = _c_times_ms(exe, in_codes, args.repeats)
            c_exact[name] &= bool(np.array_equal(np.frombuffer(out, np.uint8), out_codes))
        for name, v in t.items():
            times[name] += v
            if name != "ort":
                ratios[name].append(statistics.median(v) / statistics.median(t["ort"]))

    def summary(name: str) -> dict:
        v = times[name]
        row = {
            "median_ms": round(statistics.median(v), 2),
            "min_max_ms": [round(min(v), 1), round(max(v), 1)],
        }
        if name != "ort":
            row["over_ort_median"] = round(
                statistics.median(times[name]) / statistics.median(times["ort"]), 2
            )
            row["over_ort_per_round"] = [round(r, 2) for r in ratios[name]]
        return row

    result = {
        "model": f"resnet18_style width {args.width}, 1x3x{args.size}x{args.size}, 1 thread",
        "calls": f"{args.rounds} rounds x {args.repeats} calls per engine",
        "load_average_1min": round(os.getloadavg()[0], 2),
        "ort_qdq_optimized": summary("ort"),
        "numpy_executor": summary("numpy"),
        **{
            f"c_{name}": {
                **summary(name),
                "compile_s": round(builds[name][1], 1),
                "bit_exact_with_numpy": c_exact[name],
            }
            for name in builds
        },  # fmt: skip
        "steps": prog.op_counts(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
