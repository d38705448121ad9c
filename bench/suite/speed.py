"""Figure 2: speed of the INT8 model in ONNX Runtime and OpenVINO (CPU), float beside.

Per workload and batch size, one interleaved loop times every form: ORT float, ORT running our
QDQ export, ORT running its own ``quantize_static`` model (its fastest x86 form: QDQ, uint8
activations, int8 per-channel weights), ORT running our export folded to ONNX integer operators
(``qb.fold``; ResNet-18 only, ``FOLDED``), and the same files in OpenVINO next to OpenVINO's float
model at its default precision (bf16 on this CPU) and forced f32. The INT8 files are the
``minmax`` ones of figure 1. Ratios are per round (adjacent in time), median [min-max]; a
sample is the fastest of a few back-to-back calls for inferences under 40 ms (``timing``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from . import engines, tools
from .timing import interleave, paired_ratio, summary
from .workloads import Workload

# (numerator, denominator, what the ratio says): time ratios; > 1 means the denominator is faster
RATIOS = (
    ("ort/float", "ort/ours", "ORT: float time / our INT8 time (speed-up)"),
    ("ort/float", "ort/ort_qdq", "ORT: float time / ORT-quantized time (speed-up)"),
    ("ort/ours", "ort/ort_qdq", "ORT: our time / ORT-quantized time (<= 1: ours no slower)"),
    ("ov/float", "ov/ours", "OpenVINO: default-float time / our INT8 time (speed-up)"),
    ("ov/float_f32", "ov/ours", "OpenVINO: f32 time / our INT8 time (speed-up)"),
    ("ov/ours", "ov/ort_qdq", "OpenVINO: our time / ORT-quantized time"),
    ("ort/ours/variant", "ort/ort_qdq/variant", "ORT, FFN outputs float: ours / ORT-quantized"),
    (
        "ort/ours",
        "ort/ours_folded",
        "ORT: our QDQ time / the same model folded (>= 1: folded no slower)",
    ),
    ("ort/float", "ort/ours/variant", "ORT: float / ours with FFN outputs float (speed-up)"),
)


FOLDED = ("resnet18",)  # workloads whose QDQ export is also timed folded (QOperator)


def _models(w: Workload, files: dict[str, str], work: Path) -> dict[str, Path]:
    models = {"float": w.float_onnx}
    for key, name in (("ours/minmax", "ours"), ("ort/minmax", "ort_qdq")):
        if key in files:
            models[name] = Path(files[key])
    if w.name in FOLDED and "ours" in models:
        import quantbridge as qb

        models["ours_folded"] = work / f"{w.name}.ours.folded.onnx"
        qb.fold(models["ours"], models["ours_folded"])
    for key, path in files.items():
        if key.count("/") == 2 and key.startswith(("ours/minmax/", "ort/minmax/")):
            models[("ours" if key.startswith("ours") else "ort_qdq") + "/variant"] = Path(path)
    return models


def run(
    w: Workload,
    files: dict[str, str],
    work: Path,
    rounds: int,
    budget_s: float,
    log: Callable[[str], None],
) -> dict:
    models = _models(w, files, work)
    result: dict = {"models": {k: str(v) for k, v in models.items()}, "batches": {}, "ops": {}}
    sessions, compiled = {}, {}
    for name, path in models.items():
        opt = work / f"{w.name}.{name.replace('/', '_')}.ort-optimized.onnx"
        try:
            sessions[name] = engines.ort_session(path, opt)
            result["ops"][f"ort/{name}"] = engines.compute_ops(opt)
        except Exception as e:
            result["ops"][f"ort/{name}"] = {"error": tools.short_error(e)}
    ov_missing = engines.openvino_available()
    result["openvino"] = ov_missing or "ok"
    if ov_missing is None:
        for name, path in models.items():
            if name.endswith("/variant") or name == "ours_folded":
                continue  # OpenVINO rows: the all-int8 QDQ forms only (no com.microsoft ops)
            precisions = (None, "f32") if name == "float" else (None,)
            for precision in precisions:
                key = "float_f32" if precision == "f32" else name
                try:
                    compiled[key] = engines.ov_compile(path, precision)
                    if name == "float" and precision is None:
                        result["openvino_float_default"] = engines.ov_default_precision(
                            compiled[key]
                        )
                    result["ops"][f"ov/{key}"] = engines.ov_int8_layers(compiled[key])
                except Exception as e:
                    result["ops"][f"ov/{key}"] = {"error": tools.short_error(e)}
    for batch, feeds in w.speed_feeds.items():
        runners = {f"ort/{k}": engines.ort_runner(s, feeds) for k, s in sessions.items()}
        runners |= {f"ov/{k}": engines.ov_runner(c, feeds) for k, c in compiled.items()}
        log(f"  {w.name} {batch}: timing {len(runners)} forms, up to {rounds} interleaved rounds")
        samples = interleave(runners, rounds, warmup=2, budget_s=budget_s)
        entry: dict = {
            "ms": {k: summary(v["wall_ms"]) for k, v in samples.items()},
            "cpu_ms": {k: summary(v["cpu_ms"]) for k, v in samples.items()},
            "ratios": {},
        }
        for a, b, what in RATIOS:
            if a in samples and b in samples:
                entry["ratios"][f"{a} : {b}"] = {
                    "what": what,
                    **paired_ratio(samples[a]["wall_ms"], samples[b]["wall_ms"]),
                }
        entry["calls_per_sample"] = {k: v["calls"] for k, v in samples.items()}
        entry["raw_ms"] = {k: [round(t, 2) for t in v["wall_ms"]] for k, v in samples.items()}
        result["batches"][batch] = entry
    return result
