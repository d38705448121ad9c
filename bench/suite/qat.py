"""Figure 4: QAT training-step time, from ``bench/qat_step.py`` (a colleague's harness).

Its ``run(steps, warmup, threads, profile, log)`` times interleaved training steps of the float
model, our QAT (moving-average ranges and LSQ) and PyTorch's ``prepare_qat_fx`` on a
ResNet-18-style CNN; this module only calls it and keeps the numbers. Without the file the row
is "pending".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def run(quick: bool, log: Callable[[str], None]) -> dict:
    try:
        qat_step = importlib.import_module("bench.qat_step")
    except ImportError as e:
        return {"pending": f"bench/qat_step.py not available ({e})"}
    if not hasattr(qat_step, "run"):
        return {"pending": "bench/qat_step.py has no run() yet"}
    steps, warmup = (10, 2) if quick else (30, 5)
    report = qat_step.run(steps, warmup, 1, False, log)
    report.pop("times_ms", None)
    report["source"] = "bench/qat_step.py run(steps, warmup, threads=1)"
    report["differences"] = list(DIFFERENCES)
    return report


# What the QAT step of ours and of PyTorch FX (``get_default_qat_qconfig_mapping("x86")``) do
# differently; the report does not judge "ours / pytorch_fx" while this is not empty
DIFFERENCES = (
    "BatchNorm: FX trains fused ConvBn(ReLU) modules (BN folded into the weights every step, "
    "the folded weights fake-quantized); ours keeps BN a separate op during QAT "
    "(`qb.prepare_qat` does not fold it; `qb.freeze_batchnorm` folds it later)",
    "activations: FX x86 fake-quantizes to 7 bits (reduce_range); ours to 8 bits",
    "qb_lsq learns its step sizes (LSQ); FX's x86 QAT has moving-average ranges only",
)
