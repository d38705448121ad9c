"""``BENCHMARKS.md`` from the results dict of ``python -m bench`` (nothing is measured here)."""

from __future__ import annotations

import math

from .tools import ENTROPY_2048

METRIC_NAMES = {"top1": "top-1", "cosine": "mean cosine vs float", "sqnr_db": "SQNR dB vs float"}
# "ours never worse": a shortfall smaller than this is a tie (one digit image of 450; noise in
# the last digits of a mean cosine; 0.1 dB of SQNR)
TIES = {"top1": 1 / 450 + 1e-9, "cosine": 1e-3, "sqnr_db": 0.1}
TOOL_NAMES = {
    "quantbridge": "quantbridge (`qb.quantize` + `qb.export`, run in ORT)",
    "onnxruntime": "ONNX Runtime `quantize_static` (QDQ u8/s8 per-channel)",
    "pytorch_fx": "PyTorch FX PTQ (`prepare_fx`/`convert_fx`, torch x86 kernels)",
}


def _f(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    return f"{x:.{digits}f}"


def _ratio(r: dict | None, digits: int = 2) -> str:
    if not r:
        return "-"
    return f"**{r['median']:.{digits}f}** [{r['min']:.{digits}f}-{r['max']:.{digits}f}]"


def _ms(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"


def _primary(metric: str) -> str:
    return "sqnr_db" if metric == "sqnr" else metric


def _row_value(row: dict, key: str) -> str:
    if "error" in row:
        return f"fails: `{row['error'][:160]}`"
    if "not_applicable" in row:
        return row["not_applicable"]
    v = row.get(key)
    if key == "top1":
        return f"{100 * v:.2f} %"
    if key == "cosine":
        return f"{v:.4f}"
    return _f(v, 2)


# -- targets ------------------------------------------------------------------------------------
def targets(results: dict) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) rows for the headline table."""
    out: list[tuple[str, str, str]] = []
    out += _accuracy_targets(results)
    out += _speed_targets(results)
    out += _cost_targets(results)
    return out


def _accuracy_targets(results: dict) -> list[tuple[str, str, str]]:
    worse, better, compared = [], [], 0
    for name, entry in results["workloads"].items():
        acc = entry.get("accuracy")
        if not acc:
            continue
        key = _primary(acc["metric"])
        rows = {(r["tool"], r["method"], r.get("variant")): r for r in acc["rows"]}
        for (tool, method, variant), r in rows.items():
            if tool != "quantbridge" or key not in r:
                continue
            peers = [(("onnxruntime", method, variant), f"ORT {method}")]
            if method == "entropy" and ("onnxruntime", ENTROPY_2048, None) in rows:
                # ORT's default entropy (128 bins = 128 quantized bins) has one candidate
                # threshold, the full range: max-abs in effect, not the KL method. The same
                # method is its KL search at TensorRT's 2048 bins, which ours runs too.
                peers = [(("onnxruntime", ENTROPY_2048, None), f"ORT {ENTROPY_2048}")]
            if method == "minmax" and variant is None:
                peers.append((("pytorch_fx", "minmax", None), "FX minmax"))
            for peer_key, label in peers:
                peer = rows.get(peer_key)
                if peer is None or "not_applicable" in peer:
                    continue
                compared += 1
                tag = f"{name} {method}{' (' + variant + ')' if variant else ''} vs {label}"
                if "error" in peer:
                    better.append(f"{tag} (peer fails)")
                    continue
                delta = r[key] - peer[key]
                if delta < -TIES[key]:
                    worse.append(f"{tag}: {_fmt_delta(key, delta)}")
                elif delta > TIES[key]:
                    better.append(f"{tag}: +{_fmt_delta(key, delta)}")
    if not compared:
        return []
    measured = f"{compared} same-method comparisons; better on {len(better)}" + (
        f"; worse on {len(worse)}: " + "; ".join(worse) if worse else "; worse on none"
    )
    verdict = "met" if not worse and better else "**not met**"
    return [("Accuracy: ours never worse than a peer with the same method, better on >= 1",
             measured, verdict)]  # fmt: skip


def _fmt_delta(key: str, d: float) -> str:
    if key == "top1":
        return f"{100 * d:.2f} points"
    if key == "cosine":
        return f"{d:.4f} cosine"
    return f"{d:.2f} dB"


def _speed_targets(results: dict) -> list[tuple[str, str, str]]:
    out = []
    res = results["workloads"].get("resnet18", {}).get("speed", {}).get("batches", {})
    r = res.get("batch 8", {}).get("ratios", {}).get("ort/float : ort/ours")
    if r:
        out.append(("ORT: ours >= 3x faster than float, ResNet-18 batch 8",
                    f"{_ratio(r)}x", "met" if r["median"] >= 3 else "**not met**"))  # fmt: skip
    ov, slower = [], []
    for name, entry in results["workloads"].items():
        for batch, b in entry.get("speed", {}).get("batches", {}).items():
            r = b["ratios"].get("ov/float : ov/ours")
            if r:
                ov.append((f"{name} {batch}", r))
            r = b["ratios"].get("ort/ours : ort/ort_qdq")
            if r:
                slower.append((f"{name} {batch}", r))
    if ov:
        ok = all(r["median"] > 1 for _, r in ov)
        text = "; ".join(f"{n} {r['median']:.2f}x" for n, r in ov)
        out.append(("OpenVINO: ours faster than OpenVINO float (default precision)", text,
                    "met" if ok else "**not met**"))  # fmt: skip
    if slower:
        worst = max(r["median"] for _, r in slower)
        text = "; ".join(
            f"{n} {r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]" for n, r in slower
        )
        if worst <= 1.0:
            verdict = "met"
        elif worst <= 1.10:
            verdict = "met within noise (median <= 1.10, spans 1)"
        else:
            verdict = "**not met**"
        out.append(("ORT: ours never slower than ORT's fastest quantized form (time ratio <= 1)",
                    text, verdict))  # fmt: skip
    return out


COST_KEYS = ("cost", "cost_ocr_det")  # figure 3 runs: ResNet-18-style, then the OCR detector


def _cost_targets(results: dict) -> list[tuple[str, str, str]]:
    out = []
    for key in COST_KEYS:
        cost = results.get(key)
        if not cost:
            continue
        model = "OCR det" if cost.get("workload") == "ocr_det" else "ResNet-18"
        small = cost["samples"] < 64
        for method in ("percentile", "entropy"):
            s = cost["summary"].get(method)
            if not s or "error" in s:
                continue
            sp, mem = s["speedup"], s["memory_ratio"]
            label = f"{model} {method}"
            if small:  # ORT keeps every calibration output in memory: its peak grows with samples
                label += f", {cost['samples']} samples (target stated for 64)"
            out.append((f"Cost, {label}: >= 2x faster than ORT quantize_static",
                        f"{_ratio(sp)}x (ORT time / ours)", "met" if sp["median"] >= 2 else "**not met**"))  # fmt: skip
            out.append((f"Cost, {label}: <= half ORT's peak memory",
                        f"{_ratio(mem)} (our peak / ORT's)", "met" if mem["median"] <= 0.5 else "**not met**"))  # fmt: skip
    return out


# -- sections -----------------------------------------------------------------------------------
def render(results: dict) -> str:
    lines = [
        "# quantbridge benchmarks",
        "",
        f"Generated by `{results['command'].strip()}` ({results['mode']} mode) on "
        f"{results['started']}, in {results.get('total_seconds', 0) / 60:.1f} min. Raw numbers: "
        f"`bench/results/{results['mode']}.json`. How it measures: `bench/README.md`.",
        "",
    ]
    lines += _machine(results)
    rows = targets(results)
    if rows:
        lines += [
            "## Targets",
            "",
            "| target | measured (median [min-max]) | verdict |",
            "|---|---|---|",
        ]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
        lines.append("")
    lines += _reading()
    lines += _accuracy(results)
    lines += _speed(results)
    lines += _cost(results)
    lines += _qat(results)
    lines += _stages(results)
    return "\n".join(lines) + "\n"


def _reading() -> list[str]:
    """Facts about the peers that the numbers below depend on (established by this suite's
    design and the peers' code, not by one run's numbers)."""
    return [
        "## Reading these results",
        "",
        "* ONNX Runtime's `quantize_static` entropy runs at 128 histogram bins and 128 quantized "
        "bins and has no option to change them; that leaves one candidate window, the full range, "
        "so its `entropy` rows are max-abs calibration. `entropy (2048 bins)` is ORT's real KL "
        "search (TensorRT's bin count, via `create_calibrator` + a calibration cache); the "
        "accuracy target compares our `entropy` (a KL search at 2048 bins too) with it where it "
        "was run, and with ORT's default `entropy` row elsewhere.",
        "* PyTorch `x86` uses `reduce_range` (7-bit activations) by design; `minmax` is the "
        "same-method PyTorch row. FX cannot trace Hugging Face BERT under transformers 5.",
        "* The CNNs have random weights and N(0,1) inputs: their SQNR says how faithfully the "
        "INT8 graph follows float, not how a trained model would rank classes. Clipping "
        "calibrations (entropy) lose most there.",
        "* Speed rows time the `minmax` files (the calibration method does not change the graph). "
        "Figure 3 times whole fresh processes; see bench/README.md for what each side includes.",
        "",
    ]


def _machine(results: dict) -> list[str]:
    m = results["machine"]
    isa = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in m["isa"].items())
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    load0 = " / ".join(f"{x:.1f}" for x in m.get("load_average_start") or [])
    load1 = " / ".join(f"{x:.1f}" for x in m.get("load_average_end") or [])
    git = m.get("git", {})
    end = (m.get("git_end") or {}).get("commit")
    changed = f" -> {end} during the run" if end and end != git.get("commit") else ""
    return [
        "## Machine",
        "",
        f"* CPU: {m['cpu']}; {m['logical_cpus']} logical CPUs ({m['usable_cpus']} usable), "
        f"{m['memory_gib']} GiB RAM; {m['os']}, Python {m['python']}",
        f"* ISA: {isa}",
        f"* Versions: {versions}; git {git.get('commit')}{changed}"
        + (" (library modified in the working tree)" if git.get("library_modified") else ""),
        f"* Load average (1/5/15 min) at start {load0}, at end {load1}; priority: {m['priority']}. "
        "The machine is shared: absolute times move with other jobs, the ratios (interleaved "
        "runs) carry the claims.",
        "",
    ]


def _accuracy(results: dict) -> list[str]:
    out = ["## 1. Accuracy of the INT8 result", ""]
    out += [
        "Same calibration batches for every tool. Ours and ONNX Runtime's models run in ONNX "
        "Runtime, PyTorch's in torch. `percentile` is 99.999 for both tools; `entropy` uses each "
        "tool's defaults. PyTorch `x86` = `get_default_qconfig_mapping('x86')` (HistogramObserver, "
        "reduce_range: 7-bit activations); PyTorch `minmax` = MinMaxObserver quint8 + per-channel "
        "int8 weights. PT2E is not in torch 2.13 (moved to torchao), so FX is the PyTorch path.",
        "",
    ]
    for name, entry in results["workloads"].items():
        if "error" in entry:
            out += [f"### {name}", "", f"Not run: {entry['error']}", ""]
            continue
        acc = entry.get("accuracy")
        if not acc:
            continue
        key = _primary(acc["metric"])
        out += [f"### {entry['title']}", ""]
        out += [f"{n}." for n in entry.get("notes", [])]
        if acc.get("float"):
            out.append(f"Float model in ONNX Runtime: top-1 {100 * acc['float']['top1']:.2f} %.")
        out.append("")
        extra = " | text-mask IoU" if name == "ocr_det" else ""
        out += [f"| tool | method | {METRIC_NAMES[key]}{extra} | quantize s |",
                "|---|---|---|---|" + ("---|" if extra else "")]  # fmt: skip
        for r in acc["rows"]:
            method = r["method"] + (f", {r['variant']}" if r.get("variant") else "")
            iou = f" | {_f(r.get('mask_iou'), 3)}" if extra else ""
            secs = r.get("seconds") or {}
            out.append(
                f"| {TOOL_NAMES.get(r['tool'], r['tool'])} | {method} | {_row_value(r, key)}{iou} "
                f"| {_f(secs.get('total_s'), 1)} |"
            )
        out.append("")
    return out


def _speed(results: dict) -> list[str]:
    if not any("speed" in e for e in results["workloads"].values()):
        return []
    out = ["## 2. Speed of the INT8 model", ""]
    out += [
        "Wall ms per call, median [min-max] over interleaved rounds (warm-up first). ORT: CPU EP, "
        "2 threads, ORT_ENABLE_ALL, spinning off. OpenVINO: CPU, 2 threads, 1 stream, LATENCY. "
        "`ours` = our QDQ export, `ort_qdq` = ORT `quantize_static` QDQ u8/s8 per-channel "
        "(its fastest x86 form, bench/forms_study), both calibrated with the same data. Ratios "
        "are per round, median [min-max]. A sample is the fastest of `k` back-to-back calls, "
        "`k` (column `calls`) chosen in the warm-up so a sample spans about 40 ms (at most 5): "
        "short inferences on 2 shared cores are bimodal (a descheduled worker thread nearly "
        "doubles one call), long ones keep `k` = 1.",
        "",
    ]
    for entry in results["workloads"].values():
        sp = entry.get("speed")
        if not sp:
            continue
        prec = sp.get("openvino_float_default")
        out += [f"### {entry['title']}", ""]
        if sp.get("openvino") != "ok":
            out += [f"OpenVINO rows missing: {sp.get('openvino')}", ""]
        elif prec:
            out += [f"OpenVINO float default precision here: **{prec}** (`ov/float`); "
                    "`ov/float_f32` forces f32.", ""]  # fmt: skip
        for batch, b in sp["batches"].items():
            calls = b.get("calls_per_sample", {})
            out += [
                f"**{batch}**",
                "",
                "| form | ms | process CPU ms | calls |",
                "|---|---|---|---|",
            ]
            for form, s in b["ms"].items():
                cpu = _f(b["cpu_ms"][form]["median"], 1)
                out.append(f"| {form} | {_ms(s)} | {cpu} | {calls.get(form, 1)} |")
            out += ["", "| ratio | value |", "|---|---|"]
            for r in b["ratios"].values():
                out.append(f"| {r['what']} | {_ratio(r)} |")
            out.append("")
        ops = sp.get("ops", {})
        if ops:
            out += ["Compute ops after ORT optimization / OpenVINO runtime layers:", ""]
            for form, counts in ops.items():
                if "error" in counts:
                    text = f"fails: `{counts['error']}`"
                else:
                    text = ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"
                out.append(f"* `{form}`: {text}")
            out.append("")
    return out


def _cost(results: dict) -> list[str]:
    runs = [results[k] for k in COST_KEYS if results.get(k)]
    if not runs:
        return []
    out = ["## 3. Cost of quantizing", ""]
    for cost in runs:
        out += _cost_table(cost)
    return out


def _cost_table(cost: dict) -> list[str]:
    if cost["float_export_s"] > 0:
        start = (
            "Ours: `qb.quantize` + `qb.export` from the torch model. ORT: `quantize_static` from "
            "the float ONNX file; the float export it needs took "
            f"{cost['float_export_s']:.1f} s (once, in the parent) and is added only in the "
            "'incl. float export' column."
        )
    else:
        start = (
            "Both start from the same float ONNX file: ours `qb.import_onnx` + `qb.quantize` + "
            "`qb.export` (all timed), ORT `quantize_static`; no float export on either side."
        )
    out = [
        f"### {cost['model']}",
        "",
        f"{cost['samples']} calibration samples (batches of {cost['batch']}), "
        f"{cost['repeats']} repeat(s); every run is a fresh process, ours and ORT's back to back "
        f"(order alternating), each tool's libraries imported before its clock starts. {start} "
        "Peak memory = VmHWM of the process (includes torch for ours; the ORT process does not "
        "import torch); 'setup' = the peak before the timed part.",
        "",
        "| method | ours s | ORT s | speed-up (ORT s / ours s) | incl. float export | ours peak MiB (setup) | ORT peak MiB (setup) | memory ratio (ours / ORT) | ours import / calibrate / export s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, s in cost["summary"].items():
        if "error" in s:
            out.append(f"| {method} | {s['error']} |||||||")
            continue
        steps = s["ours_steps_s"]
        e2e = _ratio(s["speedup_incl_float_export"]) if cost["float_export_s"] > 0 else "-"
        out.append(
            f"| {method} | {_ms(s['ours_s'])} | {_ms(s['ort_s'])} | {_ratio(s['speedup'])} | "
            f"{e2e} | {_ms(s['ours_peak_mib'])} "
            f"({s['ours_setup_peak_mib']:.0f}) | {_ms(s['ort_peak_mib'])} "
            f"({s['ort_setup_peak_mib']:.0f}) | {_ratio(s['memory_ratio'])} | "
            f"{steps.get('import_s', 0):.1f} / {steps.get('calibrate_s', 0):.1f} / "
            f"{steps.get('export_s', 0):.1f} |"
        )
    out.append("")
    return out


def _qat(results: dict) -> list[str]:
    q = results.get("qat")
    if q is None:
        return []
    out = ["## 4. QAT training step", ""]
    if "pending" in q or "error" in q:
        return out + [f"pending: {q.get('pending') or q.get('error')}", ""]
    out += [
        f"From `bench/qat_step.py` ({q.get('model')}, batch {q.get('batch')}, "
        f"{q.get('threads')} thread(s), {q.get('steps')} interleaved steps after "
        f"{q.get('warmup')} warm-up). PyTorch peer: {q.get('pytorch_peer')}.",
        "",
        "| variant | ms per step, median [min-max] |",
        "|---|---|",
    ]
    for name, s in q["stats"].items():
        out.append(f"| {name} | {s['median_ms']:.1f} [{s['min_ms']:.1f}-{s['max_ms']:.1f}] |")
    out += ["", "| ratio of medians | value |", "|---|---|"]
    out += [f"| {k} | {v:.2f} |" for k, v in q["ratios"].items()]
    out += ["", "Checks of bench/qat_step.py: " + "; ".join(
        f"{k}: {'yes' if v else 'no'}" for k, v in q.get("checks", {}).items()), ""]  # fmt: skip
    return out


def _stages(results: dict) -> list[str]:
    st = results.get("stage_seconds", {})
    if not st:
        return []
    return [
        "## Run time per stage",
        "",
        ", ".join(f"{k} {v:.0f} s" for k, v in st.items())
        + f"; total {results.get('total_seconds', 0):.0f} s.",
        "",
    ]
