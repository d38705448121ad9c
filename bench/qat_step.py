"""QAT training-step time: quantbridge against the float model and PyTorch's own QAT.

Issue #3 target: a QAT training step at most 1.5x the float step on a ResNet-18-style CNN
(batch 16, 3x64x64, CPU), and no slower than PyTorch's ``prepare_qat_fx`` fake quantization on
the same model, measured side by side in one run.

Variants, each its own copy of ``quantbridge.zoo.resnet18_style(num_classes=10)`` in train mode
with its own SGD optimizer (momentum 0.9):

* ``float``        - the model itself;
* ``qb_ma``        - ``qb.prepare_qat(model, "int8", calib)``: moving-average activation ranges,
                     weight ranges following the weights (the default QAT);
* ``qb_lsq``       - ``qb.prepare_qat(..., learn_scales=True)``: learned step sizes (LSQ);
* ``pytorch_fx``   - ``torch.ao.quantization.quantize_fx.prepare_qat_fx`` with
                     ``get_default_qat_qconfig_mapping("x86")`` (conv-bn-relu fused QAT modules,
                     moving-average observers, per-channel weights). torch 2.13 marks
                     ``torch.ao.quantization`` deprecated but it runs; the PT2E path
                     (``torch.ao.quantization.quantize_pt2e``) is gone from torch 2.13 (moved to
                     torchao), so FX is the PyTorch peer here.

One step = ``zero_grad``, forward, cross-entropy, backward, ``optimizer.step``, on one fixed
batch. Warm-up steps first; then rounds, each timing one step of every variant, the order
rotated from round to round (interleaved A/B, so load changes on the machine hit every variant
alike). Reported: median, min and max per variant, and ratios of medians.

One thread by default: on a shared two-core machine two spinning OpenMP threads per process made
the float step 6x slower and its time swing 2.5x from step to step; one thread gives stable
medians, and the ratios are what this benchmark is about. ``--threads 0`` keeps torch's default.

Usage::

    python bench/qat_step.py [--steps 30] [--warmup 5] [--threads 1] [--json out.json]
    python bench/qat_step.py --quick            # < 1 minute: 10 steps, 2 warm-up
    python bench/qat_step.py --profile          # also: where our QAT step spends its time

``--profile`` runs cProfile over a few ``qb_ma`` / ``qb_lsq`` steps and lists the functions of
quantbridge (file:function) by their own and cumulative time, plus the torch profiler's top ops.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

import quantbridge as qb
from quantbridge.zoo import resnet18_style

BATCH = 16
SHAPE = (3, 64, 64)
NUM_CLASSES = 10
TARGET_VS_FLOAT = 1.5  # issue #3: QAT step at most 1.5x the float step
TARGET_VS_PYTORCH = 1.0  # ... and no slower than PyTorch's own fake-quant QAT


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)


def build_variants(
    x: torch.Tensor, calib: list[torch.Tensor]
) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
    """name -> (model in train mode, optimizer); every model starts from the same weights."""
    base = resnet18_style(num_classes=NUM_CLASSES)
    variants = {}
    float_model = copy.deepcopy(base).train()
    variants["float"] = float_model
    variants["qb_ma"] = qb.prepare_qat(copy.deepcopy(base), "int8", calib)
    variants["qb_lsq"] = qb.prepare_qat(copy.deepcopy(base), "int8", calib, learn_scales=True)
    variants["pytorch_fx"] = _pytorch_fx(copy.deepcopy(base).train(), x)
    return {name: (model, _sgd(model)) for name, model in variants.items()}


def _pytorch_fx(model: nn.Module, x: torch.Tensor) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation, reduce_range notes
        from torch.ao.quantization import get_default_qat_qconfig_mapping
        from torch.ao.quantization.quantize_fx import prepare_qat_fx

        return prepare_qat_fx(model, get_default_qat_qconfig_mapping("x86"), (x,)).train()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> float:
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def measure(variants, x, y, steps: int, warmup: int) -> dict[str, list[float]]:
    """Per-variant step times in seconds: warm-up, then interleaved rounds, order rotated."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            train_step(*variants[name], x, y)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(steps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            train_step(*variants[name], x, y)
            times[name].append(time.perf_counter() - start)
    return times


def summarize(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        name: {
            "median_ms": statistics.median(t) * 1e3,
            "min_ms": min(t) * 1e3,
            "max_ms": max(t) * 1e3,
            "steps": len(t),
        }
        for name, t in times.items()
    }


def ratios(stats: dict[str, dict[str, float]]) -> dict[str, float]:
    med = {name: s["median_ms"] for name, s in stats.items()}
    out = {}
    for ours in ("qb_ma", "qb_lsq"):
        out[f"{ours}/float"] = med[ours] / med["float"]
        out[f"{ours}/pytorch_fx"] = med[ours] / med["pytorch_fx"]
    out["pytorch_fx/float"] = med["pytorch_fx"] / med["float"]
    return out


def checks(r: dict[str, float]) -> dict[str, bool]:
    return {
        f"{ours} <= {TARGET_VS_FLOAT}x float": r[f"{ours}/float"] <= TARGET_VS_FLOAT
        for ours in ("qb_ma", "qb_lsq")
    } | {
        f"{ours} no slower than pytorch_fx": r[f"{ours}/pytorch_fx"] <= TARGET_VS_PYTORCH
        for ours in ("qb_ma", "qb_lsq")
    }


def format_report(report: dict) -> str:
    lines = [
        f"QAT training step, ResNet-18-style, batch {BATCH} x {'x'.join(map(str, SHAPE))}, "
        f"CPU, {report['threads']} thread(s), {report['steps']} interleaved steps "
        f"after {report['warmup']} warm-up",
        f"  {'variant':<12}{'median':>10}{'min':>10}{'max':>10}   ms",
    ]
    for name, s in report["stats"].items():
        lines.append(f"  {name:<12}{s['median_ms']:>10.1f}{s['min_ms']:>10.1f}{s['max_ms']:>10.1f}")
    lines.append(
        "ratios of medians: " + ", ".join(f"{k} {v:.2f}" for k, v in report["ratios"].items())
    )
    for name, ok in report["checks"].items():
        lines.append(f"  {'yes' if ok else 'NO ':<4}{name}")
    return "\n".join(lines)


# -- profiling ----------------------------------------------------------------------------------
def profile_ours(variants, x, y, steps: int = 5, top: int = 15) -> dict[str, dict]:
    """Per QAT variant: cProfile rows of quantbridge's own functions (file:function, per step),
    the whole profiled step time, and the torch profiler's top ops by self CPU time."""
    root = os.path.dirname(qb.__file__)
    out: dict[str, dict] = {}
    for name in ("qb_ma", "qb_lsq"):
        model, opt = variants[name]
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            train_step(model, opt, x, y)
        profiler.disable()
        stats = pstats.Stats(profiler).stats
        total = sum(own for (_, _, own, _, _) in stats.values())
        rows = [
            {
                "where": f"{os.path.relpath(path, os.path.dirname(root))}:{func}",
                "line": line,
                "calls_per_step": ncalls / steps,
                "own_ms_per_step": own / steps * 1e3,
                "cum_ms_per_step": cum / steps * 1e3,
            }
            for (path, line, func), (_, ncalls, own, cum, _) in stats.items()
            if path.startswith(root)
        ]
        rows.sort(key=lambda r: -r["cum_ms_per_step"])
        out[name] = {
            "profiled_step_ms": total / steps * 1e3,
            "functions": rows[:top],
            "torch_ops": _torch_ops(model, opt, x, y, top),
        }
    return out


def _torch_ops(model, opt, x, y, top: int, steps: int = 3) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            train_step(model, opt, x, y)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [
        {
            "op": e.key,
            "calls_per_step": e.count / steps,
            "self_ms_per_step": e.self_cpu_time_total / steps / 1e3,
        }
        for e in events
    ]


def format_profile(prof: dict[str, dict]) -> str:
    lines = []
    for name, p in prof.items():
        lines.append(
            f"\n{name}: quantbridge functions by cumulative time per step (cProfile; the whole "
            f"step takes {p['profiled_step_ms']:.1f} ms under the profiler)"
        )
        lines.append(f"  {'cum ms':>8}{'own ms':>8}{'calls':>7}  where")
        for r in p["functions"]:
            lines.append(
                f"  {r['cum_ms_per_step']:>8.2f}{r['own_ms_per_step']:>8.2f}"
                f"{r['calls_per_step']:>7.0f}  {r['where']}:{r['line']}"
            )
        lines.append(f"{name}: torch ops by self CPU time per step (torch.profiler)")
        for r in p["torch_ops"]:
            lines.append(
                f"  {r['self_ms_per_step']:>8.2f} ms {r['calls_per_step']:>5.0f}x  {r['op']}"
            )
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------
def run(steps: int, warmup: int, threads: int | None, profile: bool, log: Callable) -> dict:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    x = torch.randn(BATCH, *SHAPE)
    y = torch.randint(0, NUM_CLASSES, (BATCH,))
    calib = [torch.randn(BATCH, *SHAPE) for _ in range(2)]
    t0 = time.perf_counter()
    log("building variants (capture, calibration, prepare_qat_fx)")
    variants = build_variants(x, calib)
    setup_s = time.perf_counter() - t0
    log(f"timing {steps} interleaved steps per variant after {warmup} warm-up")
    times = measure(variants, x, y, steps, warmup)
    stats = summarize(times)
    r = ratios(stats)
    report = {
        "model": "quantbridge.zoo.resnet18_style(num_classes=10)",
        "batch": [BATCH, *SHAPE],
        "threads": torch.get_num_threads(),
        "steps": steps,
        "warmup": warmup,
        "torch": torch.__version__,
        "pytorch_peer": "torch.ao.quantization.quantize_fx.prepare_qat_fx, "
        "get_default_qat_qconfig_mapping('x86')",
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "setup_s": setup_s,
        "stats": stats,
        "times_ms": {k: [t * 1e3 for t in v] for k, v in times.items()},
        "ratios": r,
        "checks": checks(r),
    }
    if profile:
        log("profiling our QAT steps")
        report["profile"] = profile_ours(variants, x, y)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="QAT step time vs float and PyTorch FX QAT")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)"
    )
    parser.add_argument("--quick", action="store_true", help="10 steps, 2 warm-up (< 1 minute)")
    parser.add_argument("--profile", action="store_true", help="profile our QAT steps too")
    parser.add_argument("--json", help="write the report to this file")
    args = parser.parse_args(argv)
    steps, warmup = (10, 2) if args.quick else (args.steps, args.warmup)
    if steps < 10:
        parser.error("--steps must be >= 10 (median, min and max over at least 10 steps)")
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    report = run(steps, warmup, args.threads, args.profile, log)
    print(format_report(report))
    if args.profile:
        print(format_profile(report["profile"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
