"""The benchmark report's verdict logic (``bench/suite/verdicts.py``) on hand-made results.

Issue 14's review found verdicts that followed from counting, not from the tables: a failed peer
counted as our win, losses of 0.03-0.08 dB hidden as ties, speed pairs timed with different
numbers of calls, wrong engine outputs timed into a ratio, QAT ratios of unlike setups. Each test
builds the results dict by hand and checks the verdict the report would print.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.suite import accuracy_summary, cost, report, verdicts  # noqa: E402
from bench.suite.speed import check_output  # noqa: E402
from bench.suite.timing import interleave  # noqa: E402


def _row(tool, config, values, default=False, key="sqnr_db"):
    return {"tool": tool, "method": config, "config": config, "default": default,
            "values": values, key: float(np.median(values))}  # fmt: skip


def _failed(tool, config, default=False):
    return {"tool": tool, "method": config, "config": config, "default": default,
            "error": "ModuleNotFoundError: No module named 'nncf'"}  # fmt: skip


def _results(rows, metric="sqnr"):
    return {"workloads": {"w": {"accuracy": {"metric": metric, "rows": rows}}}}


def _target(results, kind):
    rows = {t[0]: t for t in verdicts.accuracy_targets(results)}
    title = next(t for t in rows if f"ours' {kind}" in t)
    return rows[title]


def test_a_failed_peer_is_not_a_win():
    rows = [_row("quantbridge", "default", [30.0], True), _failed("nncf", "default", True)]
    _, measured, verdict = _target(_results(rows), "default")
    # nothing was compared: the target cannot be met by a peer's failure
    assert measured.startswith("0 comparisons: ahead 0")
    assert "nncf" in measured and "failed" in measured
    assert verdict == "**not met**"
    comps = verdicts.compare(_results(rows)["workloads"]["w"]["accuracy"], "sqnr_db")
    assert all("delta" not in c and c["status"].startswith("peer failed") for c in comps)


def test_a_small_loss_is_a_loss_not_a_tie():
    # ORT 0.03 dB ahead (the CNN minmax case of the review): behind, and the target is not met
    rows = [_row("quantbridge", "default", [39.99], True), _row("onnxruntime", "default", [40.02], True)]  # fmt: skip
    _, measured, verdict = _target(_results(rows), "default")
    assert "behind 1" in measured and "-0.03 dB" in measured
    assert verdict == "**not met**"


def test_default_compares_with_default_and_best_with_best():
    rows = [
        _row("quantbridge", "default", [20.0], True),
        _row("quantbridge", "entropy", [26.0]),
        _row("onnxruntime", "default", [22.0], True),
        _row("onnxruntime", "u8s8 per-channel minmax", [25.0]),
    ]
    acc = _results(rows)["workloads"]["w"]["accuracy"]
    comps = {c["kind"]: c for c in verdicts.compare(acc, "sqnr_db")}
    assert comps["default"]["status"] == "behind" and comps["default"]["delta"]["median"] == -2.0
    assert (comps["best"]["ours"], comps["best"]["theirs"]) == ("entropy", "u8s8 per-channel minmax")  # fmt: skip
    assert comps["best"]["status"] == "ahead" and comps["best"]["delta"]["median"] == 1.0
    assert _target(_results(rows), "default")[2] == "**not met**"
    assert _target(_results(rows), "best")[2] == "met"


def test_differences_are_signed_per_repeat_with_their_spread():
    # repeats pair up: ours - peer = +0.5, -0.2, +0.1 -> median +0.1 [-0.2..+0.5]
    ours = _row("quantbridge", "default", [10.5, 9.8, 10.1], True)
    peer = _row("onnxruntime", "default", [10.0, 10.0, 10.0], True)
    d = verdicts.difference(ours, peer, "sqnr_db")
    assert d["n"] == 3 and d["median"] == pytest.approx(0.1)
    assert (d["min"], d["max"]) == (pytest.approx(-0.2), pytest.approx(0.5))
    assert verdicts.signed("sqnr_db", d) == "+0.10 dB [-0.20..+0.50]"
    # top-1 in points, cosine in its own units
    assert verdicts.signed("top1", {"median": -1 / 450, "n": 1}) == "-0.22 points"
    assert verdicts.signed("cosine", {"median": 0.01234, "n": 1}) == "+0.0123"


def test_variant_rows_do_not_enter_default_or_best():
    variant = {**_row("quantbridge", "minmax", [50.0]), "variant": "FFN outputs float"}
    rows = [_row("quantbridge", "default", [20.0], True), variant, _row("nncf", "default", [21.0], True)]  # fmt: skip
    comps = verdicts.compare(_results(rows)["workloads"]["w"]["accuracy"], "sqnr_db")
    assert all(c["status"] == "behind" for c in comps)


def test_a_row_onnxruntime_runs_in_float_is_not_an_int8_result():
    # ModelOpt's "max, fp32 elsewhere" on ResNet-18-style: 53.29 dB with 0 int8 convs run by ORT
    # (20 convs + Gemm float); its int8 default is the peer's best INT8 row, and it is behind ours
    def census(row, int8, floats):
        return {**row, "graph": {"ort_int8_ops": int8, "ort_float_weighted_ops": floats}}

    rows = [
        census(_row("quantbridge", "default", [36.6], True), 29, 0),
        census(_row("quantbridge", "best", [44.7]), 29, 0),
        census(_row("modelopt", "default", [8.6], True), 29, 0),
        census(_row("modelopt", "max, fp32 elsewhere", [53.3]), 0, 21),
    ]
    acc = _results(rows)["workloads"]["w"]["accuracy"]
    comps = {c["kind"]: c for c in verdicts.compare(acc, "sqnr_db")}
    assert comps["best"]["theirs"] == "default" and comps["best"]["status"] == "ahead"
    assert verdicts.not_int8(rows[3]) == "not INT8 in ORT: 0 int8 ops, 21 weighted ops float"
    assert verdicts.not_int8(rows[0]) is None and verdicts.not_int8(_row("fx", "x", [1.0])) is None
    # a peer whose only rows run in float is listed, never compared: the target is not met by it
    only_float = [rows[0], {**rows[3], "default": True}]
    _, measured, verdict = _target(_results(only_float), "best")
    assert measured.startswith("0 comparisons") and "not INT8 in ORT" in measured
    assert verdict == "**not met**"
    # the same rule holds for ours
    ours_float = [census(_row("quantbridge", "default", [60.0], True), 0, 21), rows[2]]
    comps = {c["kind"]: c for c in verdicts.compare(_results(ours_float)["workloads"]["w"]["accuracy"], "sqnr_db")}  # fmt: skip
    assert comps["default"]["status"].startswith("ours not INT8")


def _speed_results(calls, outputs):
    stat = {"median": 3.5, "min": 3.2, "max": 3.9, "n": 5}
    batch = {"ratios": {"ort/float : ort/ours": {"what": "x", **stat}}, "calls_per_sample": calls}
    if outputs is not None:
        batch["outputs"] = outputs
    return {"workloads": {"resnet18": {"speed": {"batches": {"batch 8": batch}}}}}


def test_a_speed_pair_with_unequal_calls_is_not_judged():
    ok = {"ort/float": {"ok": True}, "ort/ours": {"ok": True}}
    fair = verdicts.speed_targets(_speed_results({"ort/float": 2, "ort/ours": 2}, ok))
    assert fair[0][2] == "met"
    unfair = verdicts.speed_targets(_speed_results({"ort/float": 1, "ort/ours": 5}, ok))
    assert unfair[0][2] == "not judged" and "unequal calls per sample" in unfair[0][1]


def test_wrong_engine_outputs_are_flagged_before_a_time_counts():
    # OpenVINO's MiniLM embeddings at batch 32 came back all zeros: 0 dB against the reference
    ref = np.random.default_rng(0).standard_normal((32, 64, 384)).astype(np.float32)
    zeros = check_output(ref, np.zeros_like(ref))
    assert not zeros["ok"] and zeros["why"] == "all zeros"
    close = check_output(ref, ref + 0.01 * np.random.default_rng(1).standard_normal(ref.shape))
    assert close["ok"] and close["sqnr_db"] > 30
    assert not check_output(ref, ref[:8])["ok"]  # wrong shape
    assert not check_output(ref, np.full_like(ref, np.nan))["ok"]

    outputs = {"ort/float": {"ok": True}, "ort/ours": zeros}
    rows = verdicts.speed_targets(_speed_results({"ort/float": 1, "ort/ours": 1}, outputs))
    assert rows[0][2] == "not judged" and "wrong outputs: ort/ours (all zeros)" in rows[0][1]

    ov = {"ov/float": {"ok": True}, "ov/ours": zeros}
    r = {"median": 1.3, "min": 1.2, "max": 1.4, "n": 3}
    batch = {"ratios": {"ov/float : ov/ours": r}, "calls_per_sample": {}, "outputs": ov}
    results = {"workloads": {"minilm": {"speed": {"batches": {"batch 32": batch}}}}}
    rows = {t[0]: t for t in verdicts.speed_targets(results)}
    assert not any(t.startswith("OpenVINO") for t in rows)  # the only pair was excluded
    flagged = rows["Speed pairs excluded from the verdicts above"]
    assert "minilm batch 32 ov/float : ov/ours: wrong outputs" in flagged[1]


def test_openvino_layout_pair_is_judged_on_its_own():
    # ours in qb.openvino_layout beats OpenVINO float while the ONNX Runtime layout does not: two
    # verdicts, each from its own pair; a median at or below 1 is not met
    ok = {"ov/float": {"ok": True}, "ov/ours": {"ok": True}, "ov/ours_ov": {"ok": True}}

    def results(layout_median: float) -> dict:
        ratios = {
            "ov/float : ov/ours": {"median": 0.68, "min": 0.55, "max": 0.86, "n": 9},
            "ov/float : ov/ours_ov": {"median": layout_median, "min": 0.9, "max": 1.7, "n": 9},
        }
        batch = {"ratios": ratios, "calls_per_sample": {}, "outputs": ok}
        return {"workloads": {"ocr_det": {"speed": {"batches": {"batch 1": batch}}}}}

    rows = {t[0]: t for t in verdicts.speed_targets(results(1.34))}
    default = "OpenVINO: ours' ONNX Runtime file (`qb.export` default) faster than OpenVINO float"
    assert rows[default + " (default precision)"][2] == "**not met**"
    layout = ("OpenVINO: ours' OpenVINO file (`qb.export(..., target='openvino')` = "
              "qb.openvino_layout) faster than OpenVINO float (default precision)")  # fmt: skip
    assert rows[layout][2] == "met" and "ocr_det batch 1 **1.34** [0.90-1.70]" in rows[layout][1]
    rows = {t[0]: t for t in verdicts.speed_targets(results(1.0))}
    assert rows[layout][2] == "**not met**"


def test_interleave_same_calls_gives_every_form_the_same_count():
    runners = {"fast": lambda: None, "slow": lambda: time.sleep(0.03)}
    apart = interleave(runners, rounds=1, warmup=1, gap_s=0.0)
    assert apart["fast"]["calls"] > apart["slow"]["calls"]  # why the option exists
    same = interleave(runners, rounds=1, warmup=1, gap_s=0.0, same_calls=True)
    assert same["fast"]["calls"] == same["slow"]["calls"] == apart["fast"]["calls"]


def _cost(speedup, process, memory, memory_quantize=None):
    r = lambda m: {"median": m, "min": m, "max": m, "n": 1}  # noqa: E731
    s = {"speedup": r(speedup), "memory_ratio": r(memory), "process_speedup": r(process)}
    if memory_quantize is not None:
        s["memory_quantize_ratio"] = r(memory_quantize)
    return {"cost": {"workload": "resnet18", "samples": 64, "summary": {"percentile": s}}}


def test_cost_is_judged_in_process_and_as_whole_process():
    # 2.1x in process but the process (imports included) is slower than ORT's: one met, one not
    rows = {t[0]: t for t in verdicts.cost_targets(_cost(2.1, 0.8, 0.3))}
    assert rows["Cost, ResNet-18 percentile: in-process >= 2x faster than ORT quantize_static"][2] == "met"  # fmt: skip
    whole = rows["Cost, ResNet-18 percentile: whole process (imports included) no slower than ORT's"]  # fmt: skip
    assert whole[2] == "**not met**" and "0.80" in whole[1]
    assert rows["Cost, ResNet-18 percentile: <= half ORT's peak memory (whole process)"][2] == "met"


def test_cost_memory_is_judged_as_quantizings_increment_and_as_the_whole_process():
    # torch + the model push our whole-process peak over half ORT's while quantizing itself
    # adds 0.38x of what ORT's quantize_static adds: two rows, two verdicts
    rows = {t[0]: t for t in verdicts.cost_targets(_cost(1.0, 0.5, 0.87, 0.38))}
    whole = rows["Cost, ResNet-18 percentile: <= half ORT's peak memory (whole process)"]
    assert whole[2] == "**not met**" and "0.87" in whole[1]
    inc = rows["Cost, ResNet-18 percentile: quantizing's memory (peak over setup) <= half ORT's"]
    assert inc[2] == "met" and "0.38" in inc[1]
    over = {t[0]: t for t in verdicts.cost_targets(_cost(1.0, 0.5, 0.87, 0.51))}
    assert over[inc[0]][2] == "**not met**"
    # results written before the increment was measured: only the whole-process row
    old = [t[0] for t in verdicts.cost_targets(_cost(1.0, 0.5, 0.87))]
    assert not any("peak over setup" in label for label in old)


def test_cost_summary_pairs_each_runs_increment_over_its_setup():
    run = lambda peak, setup, rep: {  # noqa: E731
        "seconds": 1.0, "steps_s": {"total_s": 1.0}, "peak_mib": peak, "setup_peak_mib": setup,
        "setup_s": 0.1, "process_wall_s": 2.0, "repeat": rep,
    }  # fmt: skip
    runs = {
        "ours/percentile": [run(660.0, 426.0, 0), run(700.0, 430.0, 1)],
        "ort/percentile": [run(750.0, 140.0, 0), run(760.0, 160.0, 1)],
    }
    s = cost.summarize(runs, ("percentile",), 0.0)["percentile"]
    assert s["ours_quantize_mib"]["median"] == (234.0 + 270.0) / 2
    assert s["ort_quantize_mib"]["median"] == (610.0 + 600.0) / 2
    assert s["memory_quantize_ratio"]["min"] == 234.0 / 610.0  # paired within a repeat
    assert s["memory_quantize_ratio"]["max"] == 270.0 / 600.0
    assert s["memory_ratio"]["min"] == 660.0 / 750.0


def test_qat_ratio_against_pytorch_needs_like_with_like():
    q = {"ratios": {"qb_ma / pytorch_fx": 0.79, "qb_ma / float": 1.39}, "stats": {}}
    assert verdicts.qat_targets({"qat": q})[0][2] == "met"
    q["differences"] = ["PyTorch FX folds BatchNorm into the convolution during QAT"]
    row = verdicts.qat_targets({"qat": q})[0]
    assert row[2] == "not judged (not like with like)" and "folds BatchNorm" in row[1]


def test_report_prints_the_summary_table():
    rows = [
        _row("quantbridge", "default", [0.98, 0.97], True, "top1"),
        _row("onnxruntime", "default", [0.97, 0.97], True, "top1"),
        _failed("modelopt", "default", True),
    ]
    results = _results(rows, "top1")
    results["workloads"]["w"] |= {"title": "W", "notes": []}
    text = "\n".join(report._accuracy(results))
    # ours 98/97 vs ORT 97/97: +1 and 0 points per repeat -> median +0.50 [+0.00..+1.00]
    assert ("| w (top-1) | 97.50 % [97.00-98.00] | 97.50 % [97.00-98.00] (default) | onnxruntime "
            "| 97.00 % [97.00-97.00] | 97.00 % [97.00-97.00] (default) "
            "| +0.50 points [+0.00..+1.00] | +0.50 points [+0.00..+1.00] |") in text  # fmt: skip
    assert ("|  |  |  | modelopt | failed: ModuleNotFoundError: No module named 'nncf' "
            "| failed: ModuleNotFoundError: No module named 'nncf' "
            "| not compared (peer failed) | not compared (peer failed) |") in text  # fmt: skip
    assert "failed: `ModuleNotFoundError" in text  # the row itself, in the workload's table


def test_summary_table_compares_int8_rows_only_signed_with_spread():
    def census(row, int8, floats):
        return {**row, "graph": {"file_int8_weighted": int8, "file_float_weighted": floats}}

    rows = [
        _row("quantbridge", "default", [30.0, 31.0, 29.0], True),
        _row("quantbridge", "best", [35.0, 36.0, 34.0]),
        _row("onnxruntime", "default", [31.0, 30.0, 30.0], True),
        _row("onnxruntime", "x", [36.0, 35.0, 37.0]),
        _failed("nncf", "default", True),
        census(_row("modelopt", "default", [40.0, 40.0, 40.0], True), 0, 5),
        census(_row("modelopt", "max", [33.0, 33.0, 33.0]), 5, 0),
    ]
    acc = _results(rows)["workloads"]["w"]["accuracy"]
    lines = accuracy_summary.workload_rows("w", acc, "sqnr_db")
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in lines]
    assert [c[3] for c in cells] == ["onnxruntime", "nncf", "modelopt"]
    # ours' cells on the first row: default, and the best INT8 row named
    assert cells[0][:3] == ["w", "30.00 dB [29.00-31.00]", "35.00 dB [34.00-36.00] (best)"]
    # ORT: default 30 - 31, 31 - 30, 29 - 30 -> -1 [-1..+1]; best x: 35-36, 36-35, 34-37
    assert cells[0][4:] == ["30.00 dB [30.00-31.00]", "36.00 dB [35.00-37.00] (x)",
                            "**-1.00 dB [-1.00..+1.00] behind**",
                            "**-1.00 dB [-3.00..+1.00] behind**"]  # fmt: skip
    # a failed peer: its reason, never a win
    assert cells[1][4:] == ["failed: ModuleNotFoundError: No module named 'nncf'"] * 2 + [
        "not compared (peer failed)"] * 2  # fmt: skip
    # ModelOpt's default (40 dB, its convs multiply float inputs) reads so and is not compared;
    # its best INT8 row is "max", 33 dB: 35-33, 36-33, 34-33 -> +2 [+1..+3]
    assert cells[2][4] == ("40.00 dB [40.00-40.00]; not INT8: 0 weighted ops with int8 inputs, "
                           "5 with float inputs")  # fmt: skip
    assert cells[2][5:] == ["33.00 dB [33.00-33.00] (max)", "not compared (peer not INT8)",
                            "+2.00 dB [+1.00..+3.00]"]  # fmt: skip
    # the Targets table says the same: behind on ORT, the others not compared
    _, measured, verdict = _target(_results(rows), "best")
    assert "behind 1" in measured and "w vs onnxruntime -1.00 dB [-3.00..+1.00]" in measured
    assert verdict == "**not met**"


def test_both_conv_inputs_only_rows_say_their_layout_in_the_summary():
    """Ours under activation_scope="weighted_inputs" and ModelOpt's CNN file both leave their
    residual adds float (accuracy.residual_adds): the summary marks both rows, compared as any
    INT8 rows are, and an all-activations row (NNCF's: adds on int8 values) carries no mark."""

    def census(row, int8_adds, float_adds):
        graph = {"file_int8_weighted": 20, "file_float_weighted": 1,
                 "file_int8_adds": int8_adds, "file_float_adds": float_adds}  # fmt: skip
        return {**row, "graph": graph}

    rows = [
        census(_row("quantbridge", "default", [47.0], True), 8, 0),
        census(_row("quantbridge", "conv", [68.0]), 0, 8),
        census(_row("nncf", "default", [43.0], True), 8, 0),
        census(_row("modelopt", "max", [53.0], True), 0, 8),
    ]
    acc = _results(rows)["workloads"]["w"]["accuracy"]
    lines = accuracy_summary.workload_rows("w", acc, "sqnr_db")
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in lines]
    mark = "layout: 8 of 8 residual adds float"
    assert cells[0][1] == "47.00 dB"  # ours' default: every activation, no mark
    assert cells[0][2] == f"68.00 dB (conv); {mark}"
    assert cells[0][3:6] == ["nncf", "43.00 dB", "43.00 dB (default)"]
    assert cells[1][3:6] == ["modelopt", f"53.00 dB; {mark}", f"53.00 dB (max); {mark}"]
    # the marked rows are still INT8 results, compared signed: 68 - 53
    best = next(c for c in verdicts.compare(acc, "sqnr_db")
                if c["kind"] == "best" and c["peer"] == "modelopt")  # fmt: skip
    assert best["status"] == "ahead" and best["delta"]["median"] == 15.0
    # half the adds int8 or fewer float than int8: not this layout; no census: no mark
    assert verdicts.layout({"graph": {"file_int8_adds": 4, "file_float_adds": 4}}) is not None
    assert verdicts.layout({"graph": {"file_int8_adds": 5, "file_float_adds": 3}}) is None
    assert verdicts.layout({"graph": {"file_int8_weighted": 20}}) is None


def test_constant_output_sqnr_is_how_far_the_input_dependent_part_lies_below():
    """Hand-made: two samples 3 +- 1 (sum of squares 16 + 4 = 20), their deviation from the mean
    3 is +-1 (sum 2): a constant output 3 scores exactly 10 log10(20 / 2) = 10 dB."""
    from bench.suite import accuracy, report_accuracy

    ref = np.array([[4.0], [2.0]], np.float32)
    assert accuracy.constant_output_sqnr_db(ref) == pytest.approx(10.0, abs=1e-9)  # exact ratio
    # an input-independent float output: no input-dependent part, a constant is exact
    assert accuracy.constant_output_sqnr_db(np.ones((3, 2), np.float32)) == float("inf")
    assert "scores 45.80 dB" in report_accuracy.constant_note(45.8)
    results = _results(
        [_row("quantbridge", "default", [44.6], True), _row("nncf", "d", [43.0], True)]
    )
    results["workloads"]["w"]["accuracy"]["constant_sqnr_db"] = 45.8
    table = "\n".join(accuracy_summary.table(results, {"sqnr_db": "SQNR dB vs float"}))
    assert "| w (SQNR dB vs float; an output ignoring the input: 45.80 dB) | 44.60 dB |" in table


def test_summary_table_when_no_peer_row_is_int8_or_ours_failed():
    def census(row, int8, floats):
        return {**row, "graph": {"file_int8_weighted": int8, "file_float_weighted": floats}}

    rows = [
        {**_failed("quantbridge", "default", True), "error": "ValueError: bad"},
        _row("quantbridge", "native", [0.9], key="cosine"),
        census(_row("nncf", "default", [0.95], True, "cosine"), 1, 4),
    ]
    acc = _results(rows, "cosine")["workloads"]["w"]["accuracy"]
    cells = [c.strip() for c in accuracy_summary.workload_rows("w", acc, "cosine")[0].split("|")]
    assert cells[2:4] == ["failed: ValueError: bad", "0.9000 (native)"]
    assert (
        cells[6] == "no INT8 row (not INT8: 1 weighted ops with int8 inputs, 4 with float inputs)"
    )
    assert cells[7:9] == ["not compared (peer not INT8)", "not compared (peer not INT8)"]


def _engine_batch(ratio, wrapper_us, raw_ms, ok=True):
    r = lambda m: {"median": m, "min": m, "max": m, "n": 3}  # noqa: E731
    return {
        "wrapper_us": wrapper_us,
        "ms": {"raw/int8": r(raw_ms)},
        "calls_per_sample": {"torch/float": 1, "engine/int8": 1, "raw/int8": 1},
        "outputs": {"engine/int8": {"ok": ok, "why": "" if ok else "all zeros"}},
        "ratios": {"torch/float : engine/int8": r(ratio), "engine/int8 : raw/int8": r(1.02)},
    }


def test_engine_call_targets():
    batches = {"batch 1": _engine_batch(3.5, 90.0, 6.5), "batch 8": _engine_batch(2.9, 60.0, 40.0)}
    rows = {t[0]: t for t in verdicts.engine_targets({"engine": {"workloads": {"resnet18": {"batches": batches}}}})}  # fmt: skip
    speed = rows["Engine model (ORT INT8) >= 3x faster than float torch, ResNet-18 batch 8"]
    assert speed[2] == "**not met**" and "2.90" in speed[1]
    overhead = rows["Engine call overhead over a raw session < 5%, batch 1"]
    assert overhead[2] == "met" and "wrapper 1.38%" in overhead[1]  # 90 us of 6.5 ms
    batches["batch 1"] = _engine_batch(3.5, 400.0, 6.5)  # 6.2 %
    rows = {t[0]: t for t in verdicts.engine_targets({"engine": {"workloads": {"resnet18": {"batches": batches}}}})}  # fmt: skip
    assert rows["Engine call overhead over a raw session < 5%, batch 1"][2] == "**not met**"
    batches["batch 8"] = _engine_batch(3.5, 60.0, 40.0, ok=False)  # fast but wrong: not judged
    rows = {t[0]: t for t in verdicts.engine_targets({"engine": {"workloads": {"resnet18": {"batches": batches}}}})}  # fmt: skip
    row = rows["Engine model (ORT INT8) >= 3x faster than float torch, ResNet-18 batch 8"]
    assert row[2] == "not judged" and "all zeros" in row[1]


def test_report_renders_the_engine_figure_and_the_qat_differences():
    r = lambda m: {"median": m, "min": m, "max": m, "n": 3}  # noqa: E731
    ms = {k: r(5.0) for k in ("torch/float", "torch/qmodel", "engine/int8", "raw/int8")}
    batch = {**_engine_batch(3.2, 80.0, 5.0, ok=False), "ms": ms}
    batch["ratios"]["torch/qmodel : engine/int8"] = r(4.0)
    results = {"engine": {"rounds": 4, "threads": 2, "workloads": {"resnet18": {"batches": {"batch 8": batch}}}},  # fmt: skip
               "qat": {"stats": {}, "ratios": {"qb_ma/pytorch_fx": 0.8}, "differences": ["BN"]}}  # fmt: skip
    text = "\n".join(report._engine(results) + report._qat(results))
    assert "## 5. The engine model's call" in text
    assert "| resnet18 | 8 | 5.00 |" in text and "**outputs wrong: all zeros**" in text
    assert "Not like with like" in text and "* BN" in text


def test_cost_summary_pairs_whole_process_times_by_repeat():
    from bench.suite.cost import summarize

    def run(seconds, wall, repeat):
        return {"seconds": seconds, "process_wall_s": wall, "repeat": repeat, "peak_mib": 100.0,
                "setup_peak_mib": 50.0, "steps_s": {"calibrate_s": seconds}}  # fmt: skip

    # ours: fast in process (2 s) but 9 s of imports and setup; ORT: 5 s and 7 s whole
    runs = {"ours/entropy": [run(2.0, 11.0, 0), run(2.5, 12.0, 1)],
            "ort/entropy": [run(5.0, 7.0, 0), run(5.0, 8.0, 1)]}  # fmt: skip
    s = summarize(runs, ("entropy",), 1.0)["entropy"]
    assert s["speedup"]["median"] == pytest.approx((5 / 2 + 5 / 2.5) / 2)
    assert s["process_speedup"]["median"] == pytest.approx((7 / 11 + 8 / 12) / 2)
    results = {"cost": {"workload": "resnet18", "samples": 64, "summary": {"entropy": s}}}
    rows = {t[0]: t[2] for t in verdicts.cost_targets(results)}
    assert (
        rows["Cost, ResNet-18 entropy: in-process >= 2x faster than ORT quantize_static"] == "met"
    )
    assert rows["Cost, ResNet-18 entropy: whole process (imports included) no slower than ORT's"] == "**not met**"  # fmt: skip


def test_every_configuration_name_makes_a_file_name():
    # regression: 'u8s8 per-channel minmax, MatMul/Gemm only' wrote into a missing folder
    from bench.suite.accuracy import file_slug
    from bench.suite.peers import configs

    for c in configs(quick=False, extra_ours=("int8_avx2",)):
        slug = file_slug(f"{c.tool}.{c.name}")
        assert "/" not in slug and " " not in slug and slug, c
    assert file_slug("onnxruntime.u8s8 per-channel minmax, MatMul/Gemm only") == (
        "onnxruntime.u8s8_per-channel_minmax_MatMul_Gemm_only"
    )
