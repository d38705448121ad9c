"""Issue 14 part 5 bench: where figure 3's in-process time goes, step by step.

    python -m bench.cost_steps                  # 16 samples, as the quick figure 3
    python -m bench.cost_steps --samples 64

Runs what ``bench.suite.cost_child`` times for ours (``qb.quantize`` with the default recipe +
``qb.export`` of ``quantbridge.zoo.resnet18_style``, calibration batches of 8, the same
pre-imports) with the steps of ``quantize`` and ``export`` wrapped in timers, and prints per
step the calls, wall seconds and CPU seconds (``time.process_time``: on a shared machine the
wall time moves with the load, the CPU time much less). A step nested in another (the capture
inside ``prepare``, the float pass inside ``correct_bias``, the optimizer inside ``_trace``) is
also counted in its parent. Nothing is changed: the functions are wrapped where ``_quantize``
and the exporter look them up.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import tempfile
import time
import warnings
from pathlib import Path

QUANTIZE = "quantbridge.torch._quantize"
STEPS = (
    (QUANTIZE, "prepare"),
    (QUANTIZE, "capture"),
    (QUANTIZE, "fold_batchnorm"),
    (QUANTIZE, "place_quantizers"),
    (QUANTIZE, "_calibrate"),
    (QUANTIZE, "freeze"),
    (QUANTIZE, "fit_weight_ranges"),
    (QUANTIZE, "fit_bias_grids"),
    (QUANTIZE, "correct_bias"),
    ("quantbridge.torch.ptq._sequential", "_float_means"),
    ("quantbridge.onnx.exporter._export", "_trace"),
    ("quantbridge.onnx.exporter._export", "reused_program"),
    ("quantbridge.onnx.exporter._torch_onnx", "_optimized"),
)


def _wrap(totals: dict, module: str, name: str) -> None:
    mod = importlib.import_module(module)
    inner = getattr(mod, name)

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            entry = totals[name]
            entry[0] += 1
            entry[1] += time.perf_counter() - wall
            entry[2] += time.process_time() - cpu

    setattr(mod, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    # the pre-imports of ``cost_child`` (imports the timed part would otherwise pay)
    import onnxscript  # noqa: F401
    import torch
    import torch.export._trace  # noqa: F401
    import torch.onnx._internal.exporter._core  # noqa: F401
    from onnxscript.function_libs.torch_lib import ops  # noqa: F401

    import quantbridge as qb
    import quantbridge.onnx.exporter._export  # noqa: F401 - wrapped below
    from quantbridge.zoo import resnet18_style

    from .suite.cost_child import calibration_batches

    totals: dict = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for module, name in STEPS:
        _wrap(totals, module, name)
    calib = [torch.from_numpy(b) for b in calibration_batches({"samples": args.samples})]
    model = resnet18_style()
    wall, cpu = time.perf_counter(), time.process_time()
    qmodel = qb.quantize(model, calib, progress=False)
    mid_wall, mid_cpu = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qb.export(qmodel, Path(folder) / "m.onnx", example_inputs=calib[0][:1], progress=False)
    end_wall, end_cpu = time.perf_counter(), time.process_time()
    print(f"{'step':24s} {'calls':>5s} {'wall s':>8s} {'cpu s':>8s}")
    for name, (calls, w, c) in totals.items():
        print(f"{name:24s} {calls:5d} {w:8.2f} {c:8.2f}")
    print(f"{'qb.quantize':24s} {1:5d} {mid_wall - wall:8.2f} {mid_cpu - cpu:8.2f}")
    print(f"{'qb.export':24s} {1:5d} {end_wall - mid_wall:8.2f} {end_cpu - mid_cpu:8.2f}")


if __name__ == "__main__":
    main()
