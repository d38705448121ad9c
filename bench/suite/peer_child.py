"""One out-of-process peer quantization: ``python -m bench.suite.peer_child JSON``.

NNCF and NVIDIA ModelOpt bring their own dependency pins; they may live in their own virtual
environment (``QB_BENCH_PEERS_PYTHON``, see ``peers``). This module imports neither torch nor
quantbridge: only the peer, onnx and numpy. Spec: ``{"tool": "nncf"|"modelopt", "config": name,
"float_onnx": path, "calib": npz path, "out": path}``; the npz holds the calibration batches as
``"<batch index>/<input name>"``. Prints one JSON line: seconds of the peer's call (after its
imports), the peer's version and the settings it ran with.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def load_batches(npz_path: str) -> list[dict[str, np.ndarray]]:
    data = np.load(npz_path)
    batches: dict[int, dict[str, np.ndarray]] = {}
    for key in data.files:
        index, name = key.split("/", 1)
        batches.setdefault(int(index), {})[name] = data[key]
    return [batches[i] for i in sorted(batches)]


def save_batches(npz_path: Path, batches: list[dict[str, np.ndarray]]) -> None:
    np.savez(npz_path, **{f"{i}/{k}": v for i, b in enumerate(batches) for k, v in b.items()})


# -- NNCF ---------------------------------------------------------------------------------------
# config -> nncf.quantize keyword arguments (names resolved in the child, after import)
NNCF_CONFIGS = {
    "default": {},  # preset PERFORMANCE (symmetric activations), fast bias correction on
    "mixed": {"preset": "MIXED"},  # asymmetric activations: NNCF's accuracy preset
    "transformer": {"preset": "MIXED", "model_type": "TRANSFORMER"},  # SmoothQuant + MIXED
}


def nncf_quantize(spec: dict, batches: list[dict[str, np.ndarray]]) -> dict:
    import nncf
    import onnx

    kwargs = dict(NNCF_CONFIGS[spec["config"]])
    if "preset" in kwargs:
        kwargs["preset"] = getattr(nncf.QuantizationPreset, kwargs["preset"])
    if "model_type" in kwargs:
        kwargs["model_type"] = getattr(nncf.ModelType, kwargs["model_type"])
    model = onnx.load(spec["float_onnx"])
    t0 = time.perf_counter()
    quantized = nncf.quantize(model, nncf.Dataset(batches), subset_size=len(batches), **kwargs)
    seconds = time.perf_counter() - t0
    onnx.save(quantized, spec["out"])
    return {"seconds": seconds, "version": nncf.__version__, "settings": str(kwargs)}


# -- NVIDIA ModelOpt ----------------------------------------------------------------------------
MODELOPT_CONFIGS = {
    "default": {},  # quantize_mode int8: its default calibration, fp16 for what stays float
    # for a CPU engine: what stays unquantized kept in fp32, each calibration method
    "max fp32": {"calibration_method": "max", "high_precision_dtype": "fp32"},
    "entropy fp32": {"calibration_method": "entropy", "high_precision_dtype": "fp32"},
}


def modelopt_quantize(spec: dict, batches: list[dict[str, np.ndarray]]) -> dict:
    import modelopt
    from modelopt.onnx.quantization import quantize

    data = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    kwargs = dict(MODELOPT_CONFIGS[spec["config"]])
    t0 = time.perf_counter()
    try:
        quantize(
            onnx_path=spec["float_onnx"],
            quantize_mode="int8",
            calibration_data=data,
            calibration_eps=["cpu"],
            output_path=spec["out"],
            **kwargs,
        )
    except ValueError as e:
        if "Too many bins" not in str(e):
            raise
        # its histogram calibrator (ORT's HistogramCollector) bins each tensor over (-t, t): a
        # tensor holding float32's minimum (MiniLM's attention-mask bias, -3.4e38, read by an
        # Add it quantizes) makes 2t overflow to inf
        raise ValueError(f"{HISTOGRAM_OVERFLOW}: {e}") from e
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "version": modelopt.__version__, "settings": str(kwargs)}


HISTOGRAM_OVERFLOW = (
    "its histogram calibration overflows on a tensor at float32's limit (an attention-mask bias "
    "of float32 min feeding a quantized Add)"
)
QUANTIZERS = {"nncf": nncf_quantize, "modelopt": modelopt_quantize}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    batches = load_batches(spec["calib"])
    report = QUANTIZERS[spec["tool"]](spec, batches)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
