"""Figure 1's section of ``BENCHMARKS.md``: first the one summary table (``accuracy_summary``: per
workload and peer, default vs default and best vs best, signed, with spread), then every
configuration's result per workload. Nothing is measured here."""

from __future__ import annotations

import statistics

from . import accuracy_summary, verdicts

METRIC_NAMES = {"top1": "top-1", "cosine": "mean cosine vs float", "sqnr_db": "SQNR dB vs float",
                "lines": "lines read exactly", "agreement": "same class as float"}  # fmt: skip
FLOAT_NAMES = {"top1": "top-1", "lines": "lines read exactly"}
TOOL_NAMES = {
    "quantbridge": "quantbridge (`qb.quantize` + `qb.export`, run in ORT)",
    "onnxruntime": "ONNX Runtime `quantize_static` (QDQ)",
    "nncf": "NNCF `nncf.quantize` on the float ONNX file, run in ORT",
    "modelopt": "NVIDIA ModelOpt `modelopt.onnx.quantization.quantize` (int8, CPU calibration), run in ORT",
    "pytorch_fx": "PyTorch FX PTQ (`prepare_fx`/`convert_fx`, torch x86 kernels)",
}
INTRO = (
    "Same calibration batches for every tool. Each tool's **default** is its documented default "
    "call (quantbridge: `qb.quantize(model, calib)`; ONNX Runtime: `quant_pre_process` + "
    "`quantize_static` with its own defaults, int8 per-tensor activations and weights; NNCF: "
    "`nncf.quantize(model, dataset)`; ModelOpt: `quantize(..., quantize_mode='int8')`; PyTorch: "
    "`get_default_qconfig_mapping('x86')`); its **best** is its best row over every configuration "
    "run. ONNX Runtime's `entropy (2048 bins, 256 levels)` is its KL search at our resolution. "
    "Rows with several calibration repeats (each leaving one calibration batch out) show the "
    "median [min-max]; differences are ours - peer per repeat, signed, higher is better, with no "
    "tie margin; the column *ours - row* gives them for every peer configuration, against ours' "
    "default and ours' best row. A failed peer is a failed row, never a win. The last column counts the "
    "file's QuantizeLinear nodes on activations (and on float weights quantized at run time): "
    "rows that quantize less of the graph are not the same INT8 model; then how many "
    "convolutions / GEMMs multiply int8 inputs in the file (the verdicts' INT8 test), and what "
    "ONNX Runtime's optimized graph ran: its integer operators and the convolutions / GEMMs left "
    "in float (NNCF's and ModelOpt's files quantize conv inputs only, so ORT runs their convs in "
    "float on int8 values: same accuracy as an int8 engine, not ORT's int8 speed). ONNX peers "
    "get the float file at opset >= 13 with its weights as initializers (`peer_prep`): below "
    "opset 13 they cannot write per-channel weights."
)


def _value(key: str, v: float | None) -> str:
    if v is None:
        return "-"
    if key in ("top1", "lines", "agreement"):
        return f"{100 * v:.2f} %"
    if key == "cosine":
        return f"{v:.4f}"
    return f"{v:.2f}"


def cell(row: dict, key: str) -> str:
    if "error" in row:
        return f"failed: `{row['error'][:160]}`"
    if "not_applicable" in row:
        return row["not_applicable"]
    values = row.get("values") or [row.get(key)]
    text = _value(key, verdicts.row_value(row, key))
    if len(values) > 1:
        text += f" [{_value(key, min(values))}-{_value(key, max(values))}]"
    return text


SUMMARY = (
    "### Summary: ours and every peer, default and best, per workload",
    "",
    "Values are median [min-max] over calibration repeats; *ours best* and *peer best* are the "
    "best INT8 row of each tool (named); differences are ours - peer per repeat, median "
    "[min..max], **bold** where ours is behind. A failed peer reads `failed: <reason>` and a "
    "file whose convs / GEMMs mostly multiply float inputs reads `not INT8`: neither is "
    "compared. Every row behind these cells is in the per-workload tables below.",
    "",
)


def section(results: dict) -> list[str]:
    out = ["## 1. Accuracy of the INT8 result", "", INTRO, ""]
    summary = accuracy_summary.table(results, METRIC_NAMES)
    out += [*SUMMARY, *summary] if summary else []
    for name, entry in results["workloads"].items():
        if "error" in entry:
            out += [f"### {name}", "", f"Not run: {entry['error']}", ""]
            continue
        acc = entry.get("accuracy")
        if not acc:
            continue
        key = verdicts.primary(acc["metric"])
        out += [f"### {entry['title']}", ""]
        out += [f"{n}." for n in entry.get("notes", [])]
        if acc.get("float"):
            out.append(f"Float model in ONNX Runtime: {FLOAT_NAMES[key]} "
                       f"{_value(key, acc['float'][key])}.")  # fmt: skip
        if acc.get("constant_sqnr_db") is not None:
            out.append(constant_note(acc["constant_sqnr_db"]))
        out += [f"Calibration repeats per row: {acc.get('repeats', 1)}.", ""]
        extra = {"ocr_det": " | text-mask IoU", "ocr_cls": " | logit SQNR dB"}.get(name, "")
        out += [f"| tool | configuration | {METRIC_NAMES[key]}{extra} | ours - row (default / best) | quantize s | activation Q (+ float weights Q'd at run time) |",
                "|---|---|---|---|---|---|" + ("---|" if extra else "")]  # fmt: skip
        for r in acc["rows"]:
            config = r.get("config", r["method"])
            config += " (default)" if r.get("default") and config != "default" else ""
            config += f", {r['variant']}" if r.get("variant") else ""
            config += _fed(r)
            iou = _extra_cell(name, r) if extra else ""
            secs = (r.get("seconds") or {}).get("total_s")
            secs = "-" if secs is None else f"{secs:.1f}"
            out.append(
                f"| {TOOL_NAMES.get(r['tool'], r['tool'])} | {config} | {cell(r, key)}{iou} "
                f"| {vs_ours(acc, r, key)} | {secs} | {_coverage(r.get('graph'))} |"
            )
        out.append("")
    return out


def constant_note(db: float) -> str:
    """What an output that ignores the input scores here (``accuracy.constant_output_sqnr_db``)."""
    return (
        f"An output that ignores the input (the float model's mean output over the evaluation "
        f"samples) scores {db:.2f} dB: the float output's input-dependent part lies {db:.2f} dB "
        "below its constant part, so a row's SQNR minus this value is how well it tracks the "
        "input, and a row below it tracks the input less than a constant does."
    )


def _extra_cell(workload: str, row: dict) -> str:
    """The det's text-mask IoU (repeat 0's), the classifier's logit SQNR (median [min-max] of
    the repeats: its agreement turns on one line of 32, the SQNR on every line)."""
    if workload == "ocr_det":
        iou = row.get("mask_iou")
        return " | -" if iou is None else f" | {iou:.3f}"
    values = row.get("logit_sqnr_db_values") or []
    if not values:
        return " | -"
    med = statistics.median(values)
    return f" | {med:.2f}" + (f" [{min(values):.2f}-{max(values):.2f}]" if len(values) > 1 else "")


def vs_ours(acc: dict, row: dict, key: str) -> str:
    """``ours' default - row / ours' best - row``, signed, per repeat with spread; ``-`` for
    ours' own rows and rows without a value."""
    if "config" not in row or row.get("variant"):
        return "-"
    diffs = verdicts.against_ours(acc, row, key)
    if diffs["default"] is None and diffs["best"] is None:
        return "-"
    return " / ".join("-" if d is None else verdicts.signed(key, d) for d in diffs.values())


def _fed(row: dict) -> str:
    """How the peer got its float file: ORT's pre-processing options, an opset upgrade, the
    prepared file of NNCF / ModelOpt (``peer_prep``)."""
    parts = []
    if row.get("preprocess"):
        parts.append(f"quant_pre_process {row['preprocess']}")
    elif row.get("preprocess_error"):
        parts.append("not pre-processed")
    if row.get("opset"):
        parts.append(f"opset {row['opset']}")
    prepared = row.get("prepared") or {}
    if prepared.get("constants_moved"):
        parts.append(f"{prepared['constants_moved']} Constant weights as initializers")
    if prepared.get("opset"):
        parts.append(f"opset {prepared['opset']}")
    return f" ({'; '.join(parts)})" if parts else ""


def _coverage(graph: dict | None) -> str:
    if not graph:
        return "-"
    extra = f" (+ {graph['float_weights_q']})" if graph["float_weights_q"] else ""
    ort = ""
    if "file_int8_weighted" in graph:  # the file's arithmetic (accuracy.weighted_inputs)
        ort += (f"; int8 inputs: {graph['file_int8_weighted']} of "
                f"{graph['file_int8_weighted'] + graph['file_float_weighted']} conv/gemm")  # fmt: skip
    if "file_int8_adds" in graph:  # residual adds on int8 values or not (accuracy.residual_adds)
        ort += f"; residual adds: {graph['file_int8_adds']} int8, {graph['file_float_adds']} float"
    if "ort_int8_ops" in graph:  # what ONNX Runtime's optimized graph ran (accuracy.ort_compute)
        ort += f"; ORT: {graph['ort_int8_ops']} int8 ops, {graph['ort_float_weighted_ops']} float conv/gemm"
    return f"{graph['activation_q']}{extra}{ort}"
