"""Figure 1: accuracy of the INT8 result, ours vs ONNX Runtime ``quantize_static`` vs PyTorch FX.

Every INT8 model is judged against the float model on the same held-out inputs: top-1 on digits
(against labels, float shown beside), mean cosine of sentence embeddings for MiniLM, output SQNR
in dB for the CNNs and the OCR model (plus the OCR text-mask IoU). Ours and ONNX Runtime's models
run in ONNX Runtime; PyTorch's run in torch (its quantized x86 kernels).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import engines, tools
from .workloads import Workload

NOT_BUILT = "n/a (ONNX import not built yet)"


def sqnr_db(ref: np.ndarray, out: np.ndarray) -> float:
    ref, out = ref.astype(np.float64), out.astype(np.float64)
    noise = np.sum((ref - out) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(ref**2) / noise))


def mean_cosine(ref: np.ndarray, out: np.ndarray) -> float:
    ref, out = ref.reshape(len(ref), -1).astype(np.float64), out.reshape(len(out), -1)
    out = out.astype(np.float64)
    cos = (ref * out).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(out, axis=1) + 1e-30)
    return float(cos.mean())


def mask_iou(ref: np.ndarray, out: np.ndarray, threshold: float = 0.3) -> float:
    a, b = ref > threshold, out > threshold
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


def score(w: Workload, ref: np.ndarray, out: np.ndarray) -> dict[str, float]:
    if w.metric == "top1":
        return {"top1": float((out.argmax(1) == w.labels).mean())}
    if w.metric == "cosine":
        return {"cosine": mean_cosine(ref, out)}
    result = {"sqnr_db": sqnr_db(ref, out)}
    if w.name == "ocr_det":
        result["mask_iou"] = mask_iou(ref, out)
    return result


def _ort_eval(w: Workload, path: Path, ref: np.ndarray) -> dict[str, float]:
    out = engines.ort_outputs(engines.ort_session(path), w.eval_feeds)
    return score(w, ref, out)


def _row(tool: str, method: str, fn: Callable[[], dict]) -> dict:
    try:
        return {"tool": tool, "method": method, **fn()}
    except Exception as e:  # one failing peer is a result, not a crashed suite
        return {
            "tool": tool,
            "method": method,
            "error": tools.short_error(e),
            "trace": traceback.format_exc(limit=3)[-800:],
        }


def run(
    w: Workload,
    work: Path,
    methods: tuple[str, ...],
    log: Callable[[str], None],
    prebuilt: dict[tuple[str, str], Path] | None = None,
    fx_kinds: tuple[str, ...] = ("x86", "minmax"),
    ort_only: tuple[str, ...] = (),
) -> dict:
    """Rows for one workload; ``files[(tool, method)]`` are the INT8 ONNX files (for figure 2)."""
    float_session = engines.ort_session(w.float_onnx)
    ref = engines.ort_outputs(float_session, w.eval_feeds)
    result: dict = {
        "metric": w.metric,
        "float": score(w, ref, ref) if w.metric == "top1" else None,
        "rows": [],
        "files": {},
    }
    rows, files = result["rows"], result["files"]

    for method in methods:
        path = work / f"{w.name}.ours.{method}.onnx"

        def ours(method=method, path=path) -> dict:
            if w.model is None:
                return {"not_applicable": NOT_BUILT}
            seconds = None
            if prebuilt and ("ours", method) in prebuilt:
                path = prebuilt[("ours", method)]
            else:
                seconds = tools.quantize_ours(w.model, w.calib, method, path, w.example)
            files[f"ours/{method}"] = str(path)
            return {**_ort_eval(w, path, ref), "seconds": seconds}

        log(f"  {w.name}: quantbridge {method}")
        rows.append(_row("quantbridge", method, ours))

        path_ort = work / f"{w.name}.ort.{method}.onnx"

        def ort(method=method, path=path_ort) -> dict:
            seconds = None
            if prebuilt and ("ort", method) in prebuilt:
                path = prebuilt[("ort", method)]
            else:
                seconds = tools.quantize_ort(w.float_onnx, w.calib_feeds, method, path)
            files[f"ort/{method}"] = str(path)
            return {**_ort_eval(w, path, ref), "seconds": seconds}

        log(f"  {w.name}: onnxruntime quantize_static {method}")
        rows.append(_row("onnxruntime", method, ort))

    for method in ort_only:
        path_ort = work / f"{w.name}.ort.{method.split()[0]}-extra.onnx"

        def ort_extra(method=method, path=path_ort) -> dict:
            seconds = tools.quantize_ort(w.float_onnx, w.calib_feeds, method, path)
            return {**_ort_eval(w, path, ref), "seconds": seconds}

        log(f"  {w.name}: onnxruntime {method}")
        rows.append(_row("onnxruntime", method, ort_extra))

    if w.model is not None:
        for kind in fx_kinds:

            def fx(kind=kind) -> dict:
                converted, seconds = tools.quantize_fx(w.model, w.calib, kind)
                out = tools.torch_outputs(converted, w.eval_torch)
                return {**score(w, ref, out), "seconds": {"total_s": seconds}}

            log(f"  {w.name}: pytorch FX {kind}")
            rows.append(_row("pytorch_fx", kind, fx))

    for name, (rules, excluded) in w.variants.items():
        method = "minmax"
        path = work / f"{w.name}.ours.{method}.variant.onnx"

        def ours_variant(path=path, rules=rules, method=method, name=name) -> dict:
            from quantbridge import Rule

            skip = tuple(Rule(pattern=p, skip=True) for p in rules)
            seconds = tools.quantize_ours(w.model, w.calib, method, path, w.example, skip)
            files[f"ours/{method}/{name}"] = str(path)
            return {**_ort_eval(w, path, ref), "seconds": seconds, "variant": name}

        log(f"  {w.name}: quantbridge {method}, {name}")
        rows.append(_row("quantbridge", method, ours_variant))
        path_ort = work / f"{w.name}.ort.{method}.variant.onnx"

        def ort_variant(path=path_ort, excluded=excluded, method=method, name=name) -> dict:
            seconds = tools.quantize_ort(w.float_onnx, w.calib_feeds, method, path, excluded)
            files[f"ort/{method}/{name}"] = str(path)
            return {
                **_ort_eval(w, path, ref),
                "seconds": seconds,
                "variant": name,
                "excluded_nodes": len(excluded),
            }

        log(f"  {w.name}: onnxruntime {method}, {name}")
        rows.append(_row("onnxruntime", method, ort_variant))
    return result
