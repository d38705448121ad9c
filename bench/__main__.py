"""``python -m bench``: quantbridge side by side with ONNX Runtime and PyTorch quantization.

    python -m bench                  # full run (< 30 min on 2 cores): BENCHMARKS.md, bench/results/full.json
    python -m bench --quick          # < 5 min: fewer samples, repeats and methods; same models and inputs
    python -m bench --quick --only digits --figures accuracy   # the smoke test's run
    python -m bench --help

Figures: accuracy (ours vs ONNX Runtime quantize_static vs PyTorch FX), speed (ONNX Runtime and
OpenVINO, INT8 vs float), cost (time and peak memory of quantizing, fresh process per run), qat
(training-step time, from bench/qat_step.py). See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

FIGURES = ("accuracy", "speed", "cost", "qat", "engine")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    from bench.suite.workloads import NAMES

    description = __doc__.split("\n\n")[0].replace("``", "") + " Writes BENCHMARKS.md and JSON."
    p = argparse.ArgumentParser(prog="python -m bench", description=description)
    p.add_argument("--quick", action="store_true", help="the < 5 minute mode")
    p.add_argument("--only", help=f"comma-separated workloads of {list(NAMES)}")
    p.add_argument("--figures", help=f"comma-separated figures of {list(FIGURES)}")
    p.add_argument("--json", type=Path, help="results file (default bench/results/<mode>.json)")
    p.add_argument(
        "--markdown",
        type=Path,
        help="report file (default BENCHMARKS.md for whole runs; none with --only/--figures)",
    )
    p.add_argument(
        "--ours-recipes",
        default="",
        help="comma-separated extra quantbridge rows of figure 1: preset names or names "
        "registered with bench.suite.peers.register_ours",
    )
    p.add_argument(
        "--repeats",
        type=int,
        help="calibration repeats per accuracy row (run-to-run spread; default 1 quick, 3 full)",
    )
    p.add_argument("--work", type=Path, help="folder for the ONNX files (default: a temp folder)")
    p.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="measure nothing: write the report of a results file (to --markdown, default "
        "BENCHMARKS.md) with this checkout's report code",
    )
    p.add_argument(
        "--add",
        type=Path,
        action="append",
        default=[],
        metavar="ROWS_JSON",
        help="with --render: rows measured later by `python -m bench.peer_rows` replace or join "
        "the run's rows of that workload (bench.suite.merge; the header says which and when)",
    )
    p.add_argument(
        "--boost",
        action="store_true",
        help="run in an own session with autogroup nice -10 (needs root; a shared machine)",
    )
    args = p.parse_args(argv)
    if args.add and not args.render:
        p.error("--add needs --render RUN.json: rows are merged into an earlier run's results")
    args.workloads = _pick(p, args.only, NAMES, "--only")
    args.figures_ = _pick(p, args.figures, FIGURES, "--figures")
    return args


def _pick(p: argparse.ArgumentParser, text: str | None, allowed, flag: str) -> tuple[str, ...]:
    if not text:
        return tuple(allowed)
    picked = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in picked if t not in allowed]
    if bad:
        p.error(f"{flag}: unknown {bad}; choose from {list(allowed)}")
    return picked


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import logging

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed"
    from bench.suite import machine, report

    root = Path(__file__).resolve().parents[1]
    if args.render:
        return render(args.render, args.markdown or root / "BENCHMARKS.md", root, args.add)
    boost = machine.boost_priority() if args.boost else "off"
    mode = "quick" if args.quick else "full"
    partial = bool(args.only or args.figures)
    json_path = args.json or root / "bench" / "results" / (
        f"{mode}-partial.json" if partial else f"{mode}.json"
    )
    md_path = args.markdown or (None if partial else root / "BENCHMARKS.md")
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731

    started = time.time()
    results: dict = {
        "mode": mode,
        "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "machine": {**machine.describe(root), "priority": boost},
        "workloads": {},
        "stage_seconds": {},
    }
    try:
        results["json"] = str(json_path.resolve().relative_to(root))
    except ValueError:
        results["json"] = str(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)

    load = machine.LoadSampler()

    def checkpoint(stage: str) -> None:
        """The results so far, after each stage: a run stopped before its end still leaves its
        numbers (``"incomplete"`` names the last stage done; ``--render`` reports them)."""
        so_far = {**results, "incomplete": stage, "total_seconds": time.time() - started}
        so_far["machine"] = {**results["machine"], "load_samples": load.summary()}
        json_path.write_text(json.dumps(so_far, indent=1, default=str))

    with load:
        if args.work:
            args.work.mkdir(parents=True, exist_ok=True)
            run_suite(args, args.work, results, log, checkpoint)
        else:
            with tempfile.TemporaryDirectory(prefix="qb-bench-") as work:
                run_suite(args, Path(work), results, log, checkpoint)
    results["machine"]["load_samples"] = load.summary()
    results["total_seconds"] = time.time() - started
    results["machine"]["load_average_end"] = list(os.getloadavg())
    results["machine"]["git_end"] = machine._git(root)  # the library may change under a long run
    json_path.write_text(json.dumps(results, indent=1, default=str))
    log(f"wrote {json_path}")
    text = report.render(results)
    if md_path is not None:
        md_path.write_text(text)
        log(f"wrote {md_path}")
    else:
        print(text)
    return 0


def render(json_path: Path, md_path: Path, root: Path, added: list[Path] = ()) -> int:
    """The report of an earlier run's results, by this checkout's report code (the header says
    both versions): a report fix reaches a committed run without measuring again. ``added``:
    rows files of ``bench.peer_rows`` merged in first (``bench.suite.merge``)."""
    from bench.suite import machine, merge, report

    results = json.loads(json_path.read_text())
    merge.add_files(results, list(added))
    results["rendered"] = {
        "git": machine._git(root),
        "at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "json": str(json_path),
    }
    md_path.write_text(report.render(results))
    print(f"wrote {md_path}", file=sys.stderr)
    return 0


def plan(quick: bool) -> dict:
    """What a mode runs (figure 1 repeats, cost sizes, timing rounds); figure 1's rows are
    ``bench.suite.peers.configs``."""
    from bench.suite import workloads

    if quick:
        return {
            "sizes": workloads.QUICK,
            "repeats": 1,
            "variants": False,
            "cost_methods": ("default",),
            "cost_samples": 16,
            "cost_repeats": 1,
            "rounds": 6,
            "speed_budget_s": 12.0,
        }
    return {
        "sizes": workloads.FULL,
        "repeats": 3,
        "variants": True,
        "cost_methods": ("default", "minmax", "percentile", "entropy"),
        "cost_samples": 64,
        "cost_repeats": 3,
        "rounds": 15,
        "speed_budget_s": 60.0,
    }


def run_suite(args, work: Path, results: dict, log, checkpoint=lambda stage: None) -> None:
    from bench.suite import accuracy, cost, peers, qat, speed, workloads

    p = plan(args.quick)
    if args.repeats:
        p["repeats"] = args.repeats
    extra = tuple(n.strip() for n in args.ours_recipes.split(",") if n.strip())
    configs = peers.configs(args.quick, extra)
    p["configs"] = [f"{c.tool}/{c.name}{' (default)' if c.default else ''}" for c in configs]
    results["plan"] = {**p, "sizes": asdict(p["sizes"])}
    figures = args.figures_
    for name in args.workloads:
        entry: dict = {}
        results["workloads"][name] = entry
        t0 = time.time()
        log(f"[{name}] building")
        try:
            w = workloads.BUILDERS[name](work, p["sizes"], log)
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["trace"] = traceback.format_exc(limit=4)[-1500:]
            log(f"[{name}] unavailable: {entry['error']}")
            continue
        if not p["variants"]:
            w.variants = {}
        entry["title"], entry["notes"], entry["metric"] = w.title, w.notes, w.metric
        if name == "resnet18" and "cost" in figures:
            log(f"[{name}] figure 3: cost of quantizing (fresh process per run)")
            c = cost.run(work, p["cost_methods"], p["cost_samples"], p["cost_repeats"], log)
            c.pop("files")
            results["cost"] = c
            results["stage_seconds"]["cost"] = time.time() - t0
        if name == "ocr_det" and "cost" in figures and not args.quick:
            log(f"[{name}] figure 3: cost of quantizing (fresh process per run)")
            t_cost = time.time()
            c = cost.run(
                work, p["cost_methods"], p["cost_samples"], p["cost_repeats"], log, model=name
            )
            c.pop("files")  # 256 px images: figure 1 calibrates at the workload's own size
            results["cost_ocr_det"] = c
            results["stage_seconds"]["cost_ocr_det"] = time.time() - t_cost
        files: dict[str, str] = {}
        if "accuracy" in figures or "speed" in figures:
            log(f"[{name}] figure 1: accuracy")
            picked = configs if "accuracy" in figures else speed.configs_needed(configs)
            a = accuracy.run(w, work, picked, log, p["repeats"])
            files = a.pop("files")
            if "accuracy" in figures:
                entry["accuracy"] = a
        if "speed" in figures and w.speed_feeds:
            log(f"[{name}] figure 2: speed")
            files = _prefer_minmax(files)
            entry["speed"] = speed.run(w, files, work, p["rounds"], p["speed_budget_s"], log)
        results["stage_seconds"][name] = time.time() - t0
        checkpoint(name)
    if "qat" in figures:
        t0 = time.time()
        log("[qat] figure 4: QAT training step (bench/qat_step.py)")
        try:
            results["qat"] = qat.run(args.quick, log)
        except Exception as e:
            results["qat"] = {"error": f"{type(e).__name__}: {e}"}
        results["stage_seconds"]["qat"] = time.time() - t0
        checkpoint("qat")
    if "engine" in figures:
        t0 = time.time()
        log("[engine] figure 5: qb.to_engine call vs float torch, qmodel, raw session")
        from bench import engine_call

        try:
            results["engine"] = engine_call.figure(args.quick, args.workloads, log)
        except Exception as e:
            results["engine"] = {"error": f"{type(e).__name__}: {e}"}
        results["stage_seconds"]["engine"] = time.time() - t0


def _prefer_minmax(files: dict[str, str]) -> dict[str, str]:
    """Speed rows use the minmax files; when a run made none (quick cost), any method's file
    (the graph form, hence the speed, does not depend on the calibration method)."""
    out = dict(files)
    for tool in ("ours", "ort"):
        if f"{tool}/minmax" not in out:
            for method in ("percentile", "entropy"):
                if f"{tool}/{method}" in out:
                    out[f"{tool}/minmax"] = out[f"{tool}/{method}"]
                    break
    return out


if __name__ == "__main__":
    sys.exit(main())
