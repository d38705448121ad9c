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

import numpy as np

from . import engines, tools, verdicts
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
    ("ov/float", "ov/ours_ov", "OpenVINO: default-float time / ours in qb.openvino_layout"),
    ("ort/ours/variant", "ort/ort_qdq/variant", "ORT, FFN outputs float: ours / ORT-quantized"),
    (
        "ort/ours",
        "ort/ours_folded",
        "ORT: our QDQ time / the same model folded (>= 1: folded no slower)",
    ),
    ("ort/float", "ort/ours/variant", "ORT: float / ours with FFN outputs float (speed-up)"),
)


FOLDED = ("resnet18",)  # workloads whose QDQ export is also timed folded (QOperator)
# our export through qb.openvino_layout (Q/DQ only where OpenVINO runs int8): timed in OpenVINO
# only, checked against ONNX Runtime node by node on the same file
OV_ONLY = ("ours_ov",)
# An engine's output below this SQNR against the same file run node by node (ORT, graph
# optimizations off) is wrong, and its times do not count. Low on purpose: it catches broken
# results (OpenVINO's all-zero MiniLM embeddings at batch 32 read 0 dB), not kernel rounding
# (u8s8 saturation on AVX2 CPUs without VNNI costs a few LSB: ~16 dB on MiniLM, cosine 0.989).
MIN_OUTPUT_SQNR_DB = 10.0
SPEED_CONFIGS = ("quantbridge/default", "onnxruntime/u8s8 per-channel minmax")


def configs_needed(configs: list) -> list:
    """The figure 1 configurations whose files figure 2 times (a speed-only run)."""
    return [c for c in configs if f"{c.tool}/{c.name}" in SPEED_CONFIGS]


def check_output(ref: np.ndarray, out: np.ndarray) -> dict:
    """``{"sqnr_db", "ok", "why"}`` of an engine's first output against the reference run."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        return {"sqnr_db": None, "ok": False, "why": f"shape {out.shape}, expected {ref.shape}"}
    if not np.all(np.isfinite(out)):
        return {"sqnr_db": None, "ok": False, "why": "non-finite values"}
    noise, signal = float(np.sum((ref - out) ** 2)), float(np.sum(ref**2))
    sqnr = float("inf") if noise == 0 else 10 * float(np.log10(max(signal, 1e-300) / noise))
    ok = sqnr >= MIN_OUTPUT_SQNR_DB
    why = "" if ok else f"SQNR {sqnr:.1f} dB vs the node-by-node ORT run (< {MIN_OUTPUT_SQNR_DB})"
    if not ok and not np.any(out):
        why = "all zeros"
    return {"sqnr_db": sqnr, "ok": ok, "why": why}


def _first(out) -> np.ndarray:
    """First output of an ORT run (list) or an OpenVINO request (OVDict)."""
    return np.asarray(next(iter(out.values())) if hasattr(out, "values") else out[0])


def _form_model(form: str) -> str:
    """'ov/float_f32' -> 'float'; 'ort/ours/variant' -> 'ours/variant'."""
    name = form.split("/", 1)[1]
    return "float" if name == "float_f32" else name


def _models(w: Workload, files: dict[str, str], work: Path) -> dict[str, Path]:
    models = {"float": w.float_onnx}
    for key, name in (("ours/minmax", "ours"), ("ort/minmax", "ort_qdq")):
        if key in files:
            models[name] = Path(files[key])
    if w.name in FOLDED and "ours" in models:
        import quantbridge as qb

        models["ours_folded"] = work / f"{w.name}.ours.folded.onnx"
        qb.fold(models["ours"], models["ours_folded"])
    if "ours" in models:
        import quantbridge as qb

        models["ours_ov"] = work / f"{w.name}.ours.openvino.onnx"
        qb.openvino_layout(models["ours"], models["ours_ov"])
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
    sessions, compiled, references = {}, {}, {}
    for name, path in models.items():
        opt = work / f"{w.name}.{name.replace('/', '_')}.ort-optimized.onnx"
        try:
            references[name] = engines.ort_session(path, optimize=False)
            if name in OV_ONLY:
                continue
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
        outputs = {}
        for form, runner in runners.items():  # checked before a time counts
            try:
                ref = _first(engines.ort_runner(references[_form_model(form)], feeds)())
                outputs[form] = check_output(ref, _first(runner()))
            except Exception as e:
                outputs[form] = {"ok": False, "why": tools.short_error(e)}
            if not outputs[form]["ok"]:
                log(f"  {w.name} {batch}: {form} outputs wrong ({outputs[form]['why']})")
        log(f"  {w.name} {batch}: timing {len(runners)} forms, up to {rounds} interleaved rounds")
        samples = interleave(runners, rounds, warmup=2, budget_s=budget_s, same_calls=True)
        entry: dict = {
            "outputs": outputs,
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
                problem = verdicts.pair_problem(
                    {"outputs": outputs, "calls_per_sample": _calls(samples)}, a, b
                )
                if problem:
                    entry["ratios"][f"{a} : {b}"]["excluded"] = problem
        entry["calls_per_sample"] = _calls(samples)
        entry["raw_ms"] = {k: [round(t, 2) for t in v["wall_ms"]] for k, v in samples.items()}
        result["batches"][batch] = entry
    return result


def _calls(samples: dict) -> dict[str, int]:
    return {k: v["calls"] for k, v in samples.items()}
