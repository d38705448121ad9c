"""Figure 3: cost of quantizing - wall time and peak memory, ours vs ONNX Runtime.

Each measurement is a fresh process (``bench.suite.cost_child``); its peak resident set size is
the ``VmHWM`` of its own address space (see ``cost_child`` for why not ``ru_maxrss``). Runs are
interleaved: for each repeat and method, ours and ONNX Runtime's run back to back, the order
alternating, and time ratios are paired within a repeat.

Two times per run: the timed part inside the process (below) and the whole process's wall time
from start to exit, imports and setup included (``process_wall_s``).

Methods: ``"default"`` is what each tool's user gets with no options (``qb.quantize`` with no
recipe: the "default" preset, bias correction included; ``quantize_static`` with no options:
MinMax, QInt8, per-tensor), the figure's headline; the others are one calibration method on
each side (ours in the ``int8`` preset, ORT in the suite's u8/s8 per-channel form).

A run's time counts only when its file's output is right: after each run the parent runs the
written file in ONNX Runtime (node by node) on the first calibration batch and compares it
with the float model's (``speed.check_output``: SQNR >= 10 dB, which catches broken files,
not quantization error); a file that fails makes the run an error with the reason.

What is timed: calibration + export from the torch model for ours; ``quantize_static`` from the
float ONNX file for ONNX Runtime (the float export it needs is timed once apart and reported
beside, since a torch user pays it too). For the OCR detector, an ONNX model, both start from
the same file: ours' time includes ``qb.import_onnx``.

Two memory figures. The whole process's peak includes each process's baseline: torch (imported
by ours, not by the ONNX Runtime child), the model, the calibration arrays. Quantizing's own
memory is the peak minus the peak after setup (``memory_quantize_ratio``): what the call adds
to a process that already holds its libraries and model. Issue 14's "peak memory <= 0.5x" is
judged on that one (``bench/README.md``); the whole-process ratio is judged and shown beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import engines
from .speed import check_output
from .timing import paired_ratio
from .workloads import ROOT, export_float


def _run_child(spec: dict, timeout_s: float) -> dict:
    """Run one child (fresh interpreter) and collect its report."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out_path = Path(spec["out"]).with_suffix(".child.json")
    err_path = Path(spec["out"]).with_suffix(".child.err")
    t0 = time.perf_counter()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.suite.cost_child", json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=err,
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"error": f"timed out after {timeout_s:.0f} s"}
        except BaseException:  # Ctrl-C / kill of the suite: no orphaned child
            proc.kill()
            proc.wait()
            raise
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        lines = [ln for ln in err_path.read_text().splitlines() if ln.strip()]
        return {"error": f"exit {proc.returncode}: {lines[-1][:300] if lines else ''}"}
    report = json.loads(out_path.read_text().strip().splitlines()[-1])
    return {
        "seconds": report["seconds"]["total_s"],
        "steps_s": report["seconds"],
        "peak_mib": report["peak_kib"] / 1024,
        "setup_peak_mib": report["peak_setup_kib"] / 1024,
        "setup_s": report["setup_s"],
        "process_wall_s": wall,
    }


OCR_COST_SIZE = 256  # the OCR images' side in figure 3 (ORT keeps every activation of every image)


def run(
    work: Path,
    methods: tuple[str, ...],
    samples: int,
    repeats: int,
    log: Callable[[str], None],
    timeout_s: float = 600,
    model: str = "resnet18",
) -> dict:
    """``samples`` calibration samples in batches of 8 of ``model``: the ResNet-18-style CNN at
    3x224x224 (ours from the torch model, ORT from its float export), or the PP-OCRv4 detector
    on rendered text at 3x256x256 (both from the same float ONNX file: ours through
    ``qb.import_onnx``)."""
    if model == "ocr_det":
        from .workloads import ocr_det_path

        float_path, float_export_s = ocr_det_path(), 0.0
        title = (
            f"PP-OCRv4 detection (real ONNX), 3x{OCR_COST_SIZE}x{OCR_COST_SIZE} rendered text; "
            "both tools start from the float ONNX file (ours: `qb.import_onnx`, timed)"
        )
    else:
        import torch

        from quantbridge.zoo import resnet18_style

        float_path = work / "resnet18.cost.float.onnx"
        t0 = time.perf_counter()
        export_float(resnet18_style(), float_path, torch.zeros(1, 3, 224, 224))
        float_export_s = time.perf_counter() - t0
        title = "ResNet-18-style (quantbridge.zoo.resnet18_style), 3x224x224"
    runs: dict[str, list[dict]] = {}
    files: dict[tuple[str, str], Path] = {}
    for rep in range(repeats):
        for i, method in enumerate(methods):
            order = ("ours", "ort") if (rep + i) % 2 == 0 else ("ort", "ours")
            for tool in order:
                out = work / f"{model}.cost.{tool}.{method}.onnx"
                spec = {
                    "tool": tool,
                    "method": method,
                    "samples": samples,
                    "float_onnx": str(float_path),
                    "out": str(out),
                    "model": model,
                    "size": OCR_COST_SIZE,
                }
                log(f"  cost ({model}): repeat {rep + 1}/{repeats}, {tool} {method}")
                r = _run_child(spec, timeout_s)
                if "error" not in r:
                    r["output"] = _check_file(out, float_path, spec)
                    if not r["output"]["ok"]:
                        r["error"] = f"wrong outputs: {r['output']['why']}"
                r["repeat"] = rep
                runs.setdefault(f"{tool}/{method}", []).append(r)
                if "error" not in r:
                    files[(tool, method)] = out
                else:
                    log(f"    {r['error']}")
    return {
        "model": title,
        "workload": model,
        "samples": samples,
        "batch": 8,
        "repeats": repeats,
        "float_export_s": float_export_s,
        "runs": runs,
        "summary": summarize(runs, methods, float_export_s),
        "files": files,
    }


def _check_file(path: Path, float_path: Path, spec: dict) -> dict:
    """``check_output`` of the quantized file against the float file on the first calibration
    batch, both run in ONNX Runtime with graph optimizations off."""
    from .cost_child import calibration_batches

    batch = calibration_batches(spec)[0]

    def first_output(p: Path):
        session = engines.ort_session(p, optimize=False)
        return session.run(None, {session.get_inputs()[0].name: batch})[0]

    try:
        result = check_output(first_output(Path(float_path)), first_output(path))
    except Exception as e:  # a file ORT cannot load or run is a wrong output too
        return {"sqnr_db": None, "ok": False, "why": f"ORT cannot run it: {str(e)[:200]}"}
    if not result["ok"] and result["sqnr_db"] is not None and "zeros" not in result["why"]:
        result["why"] = f"SQNR {result['sqnr_db']:.1f} dB against the float file (< 10)"
    return result


def summarize(runs: dict[str, list[dict]], methods, float_export_s: float) -> dict:
    out = {}
    for method in methods:
        ours = [r for r in runs.get(f"ours/{method}", []) if "error" not in r]
        ort = [r for r in runs.get(f"ort/{method}", []) if "error" not in r]
        if not ours or not ort:
            errors = sorted(
                {f"{tool}: {r['error']}" for tool in ("ours", "ort")
                 for r in runs.get(f"{tool}/{method}", []) if "error" in r}
            )  # fmt: skip
            out[method] = {"error": "; ".join(errors) or "missing runs"}
            continue
        pairs = {r["repeat"]: r for r in ort}
        matched = [(o, pairs[o["repeat"]]) for o in ours if o["repeat"] in pairs]
        speedup = paired_ratio(
            [b["seconds"] for _, b in matched], [a["seconds"] for a, _ in matched]
        )
        speedup_e2e = paired_ratio(
            [b["seconds"] + float_export_s for _, b in matched], [a["seconds"] for a, _ in matched]
        )
        # whole process: interpreter start, imports, setup, the timed part, exit (issue 14: a
        # user's script pays all of it; the in-process time hides the imports)
        process = paired_ratio(
            [b["process_wall_s"] for _, b in matched], [a["process_wall_s"] for a, _ in matched]
        )
        memory = paired_ratio(
            [a["peak_mib"] for a, _ in matched], [b["peak_mib"] for _, b in matched]
        )
        # what quantizing itself costs: each process's peak over its own peak after setup
        # (ours: torch, the libraries and the model already loaded; ORT: onnx, onnxruntime)
        memory_quantize = paired_ratio(
            [_increment(a) for a, _ in matched], [_increment(b) for _, b in matched]
        )
        out[method] = {
            "ours_s": _stats([r["seconds"] for r in ours]),
            "ort_s": _stats([r["seconds"] for r in ort]),
            "ours_peak_mib": _stats([r["peak_mib"] for r in ours]),
            "ort_peak_mib": _stats([r["peak_mib"] for r in ort]),
            "ours_setup_peak_mib": statistics.median(r["setup_peak_mib"] for r in ours),
            "ort_setup_peak_mib": statistics.median(r["setup_peak_mib"] for r in ort),
            "ours_steps_s": {
                k: statistics.median(r["steps_s"][k] for r in ours) for k in ours[0]["steps_s"]
            },
            "speedup": speedup,  # ORT time / our time, per repeat
            "speedup_incl_float_export": speedup_e2e,
            "ours_process_s": _stats([r["process_wall_s"] for r in ours]),
            "ort_process_s": _stats([r["process_wall_s"] for r in ort]),
            "process_speedup": process,  # ORT process wall / ours, per repeat
            "memory_ratio": memory,  # our peak / ORT's peak, per repeat
            "ours_quantize_mib": _stats([_increment(r) for r in ours]),
            "ort_quantize_mib": _stats([_increment(r) for r in ort]),
            "memory_quantize_ratio": memory_quantize,  # our peak over setup / ORT's, per repeat
        }
    return out


def _increment(run: dict) -> float:
    """MiB the timed part added to the process's peak (peak minus the peak after setup)."""
    return run["peak_mib"] - run["setup_peak_mib"]


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
