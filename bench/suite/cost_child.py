"""One quantization in a fresh process, for figure 3: ``python -m bench.suite.cost_child JSON``.

JSON: ``{"tool": "ours"|"ort", "method": ..., "samples": N, "float_onnx": path, "out": path,
"model": "resnet18"|"ocr_det", "size": S}`` (``size``: the OCR images' side). Method
``"default"``: ours with no recipe (``qb.quantize``'s default), ORT's ``quantize_static`` with
no options (MinMax, QInt8 activations and weights, per-tensor).
Setup (imports -- for ours also the tracer, the ONNX exporter and onnxscript's torchlib
translations (1.1 s CPU, imported at the first export) that torch would load lazily, as the
ONNX Runtime side imports ``onnxruntime.quantization`` before its clock -- the model, the
calibration arrays) happens first and is not timed; then the
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


def calibration_batches(spec: dict):
    """The calibration batches (numpy, batches of 8) of the spec's model."""
    from .workloads import CALIB_SEED, seeded_randn

    if spec.get("model", "resnet18") == "ocr_det":
        from . import ocr_data

        n, size = spec["samples"], spec["size"]
        return [ocr_data.batch(range(i, min(i + 8, n)), size) for i in range(0, n, 8)]
    return seeded_randn(CALIB_SEED, spec["samples"], 8)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    t_start = time.perf_counter()
    from . import tools

    batches = calibration_batches(spec)
    if spec["tool"] == "ours":
        # the libraries ours calls into are imported before the clock starts, as ONNX Runtime's
        # quantization package is (tools.quantize_ort imports it before starting its clock):
        # torch loads its tracer and ONNX exporter lazily, on first use
        import onnxscript  # noqa: F401
        import torch
        import torch._dynamo  # noqa: F401
        import torch.export  # noqa: F401
        import torch.export._trace  # noqa: F401 - the tracer itself: ``torch.export`` loads it lazily
        import torch.onnx._internal.exporter._core  # noqa: F401
        from onnxscript._framework_apis import torch_2_8  # noqa: F401 - the exporter's optimizer
        from onnxscript.function_libs.torch_lib import ops  # noqa: F401 - its translations

        from quantbridge.zoo import resnet18_style

        # the OCR model is an ONNX file: ours starts from it as ORT does (import_onnx is timed)
        model = spec["float_onnx"] if spec.get("model") == "ocr_det" else resnet18_style()
        calib = [torch.from_numpy(b) for b in batches]
        example = calib[0][:1]
        setup_s = time.perf_counter() - t_start
        rss_setup = peak_rss_kib()
        method = None if spec["method"] == tools.DEFAULT else spec["method"]  # None: qb default
        seconds = tools.quantize_ours(model, calib, method, Path(spec["out"]), example)
    else:
        import onnx

        name = onnx.load(spec["float_onnx"], load_external_data=False).graph.input[0].name
        feeds = [{name: b} for b in batches]
        setup_s = time.perf_counter() - t_start
        rss_setup = peak_rss_kib()
        method, settings = spec["method"], None
        if method == tools.DEFAULT:  # quantize_static with no options: MinMax, ORT's defaults
            method, settings = "minmax", tools.ORT_OWN_DEFAULTS
        seconds = tools.quantize_ort(
            Path(spec["float_onnx"]), feeds, method, Path(spec["out"]), settings=settings
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
