"""One quantization in a fresh process, for figure 3: ``python -m bench.suite.cost_child JSON``.

JSON: ``{"tool": "ours"|"ort", "method": ..., "samples": N, "float_onnx": path, "out": path}``.
Setup (imports, the model, the calibration arrays) happens first and is not timed; then the
timed part: calibration + export for ours (``qb.quantize`` + ``qb.export`` from the torch
model), ``quantize_static`` for ONNX Runtime (from the float ONNX file, which the parent
exported once; torch is not even imported here). Prints one JSON line: seconds of the timed
part, and the peak resident set size after setup and at the end.

Peak RSS is ``VmHWM`` from ``/proc/self/status``: the high-water mark of this process's own
address space. Not ``ru_maxrss``: on Linux a child's ``ru_maxrss`` (``os.wait4``,
``RUSAGE_CHILDREN``) starts at its parent's RSS at fork time - ``execve`` keeps the old address
space's high-water mark - so every child of a 600 MB parent reports at least 600 MB.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def peak_rss_kib() -> int:
    """High-water mark of this process's own resident set (kB), or ru_maxrss off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    t_start = time.perf_counter()
    from . import tools
    from .workloads import CALIB_SEED, seeded_randn

    batches = seeded_randn(CALIB_SEED, spec["samples"], 8)
    if spec["tool"] == "ours":
        import torch

        from quantbridge.zoo import resnet18_style

        model = resnet18_style()
        calib = [torch.from_numpy(b) for b in batches]
        example = calib[0][:1]
        setup_s = time.perf_counter() - t_start
        rss_setup = peak_rss_kib()
        seconds = tools.quantize_ours(model, calib, spec["method"], Path(spec["out"]), example)
    else:
        import onnx

        name = onnx.load(spec["float_onnx"], load_external_data=False).graph.input[0].name
        feeds = [{name: b} for b in batches]
        setup_s = time.perf_counter() - t_start
        rss_setup = peak_rss_kib()
        seconds = tools.quantize_ort(
            Path(spec["float_onnx"]), feeds, spec["method"], Path(spec["out"])
        )
    report = {
        "seconds": seconds,
        "setup_s": setup_s,
        "peak_setup_kib": rss_setup,
        "peak_kib": peak_rss_kib(),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
