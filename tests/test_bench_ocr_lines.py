"""The bench's OCR line metrics (``bench/suite/ocr_lines.py``) and their report, on hand-made
outputs: greedy CTC read-out, lines read exactly, same class as float, and the accuracy table's
per-row signed differences against ours (``report_accuracy.vs_ours``). No model runs here."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.suite import accuracy, ocr_lines, report_accuracy, verdicts  # noqa: E402
from bench.suite.workloads import Workload  # noqa: E402

CHARS = ["<blank>", "a", "b", "c", " "]


def _probs(steps: list[list[int]]) -> np.ndarray:
    """One-hot ``N x T x C`` outputs with the given best class per step (softmax-like values)."""
    out = np.full((len(steps), len(steps[0]), len(CHARS)), 0.01, np.float32)
    for n, row in enumerate(steps):
        for t, c in enumerate(row):
            out[n, t, c] = 0.96
    return out


def test_greedy_ctc_merges_repeats_and_drops_blanks():
    # "aa_b_bb" -> "abb": the blank between two b's keeps both; "a a" keeps the space class
    steps = [[1, 1, 0, 2, 0, 2, 2], [1, 4, 4, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]]
    assert ocr_lines.ctc_greedy(_probs(steps), CHARS) == ["abb", "a a", ""]
    with pytest.raises(ValueError, match="N x T x C"):
        ocr_lines.ctc_greedy(np.zeros((2, 5)), CHARS)


def test_lines_read_counts_exact_matches_only():
    steps = [[1, 2, 3, 0], [1, 2, 0, 0], [3, 3, 3, 3], [2, 0, 2, 1]]
    # "abc" right, "ab" is not "abc" (a dropped character is a wrong line), "c" right, "bba" right
    texts = ["abc", "abc", "c", "bba"]
    assert ocr_lines.lines_read(_probs(steps), texts, CHARS) == 0.75
    with pytest.raises(ValueError, match="3 read-outs for 4 lines"):
        ocr_lines.lines_read(_probs(steps[:3]), texts, CHARS)


def test_same_label_is_agreement_with_float_not_with_the_truth():
    ref = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]], np.float32)
    out = np.array([[0.7, 0.3], [0.9, 0.1], [0.51, 0.49], [0.1, 0.9]], np.float32)
    assert ocr_lines.same_label(ref, out) == 0.75  # line 1 flipped its class
    assert ocr_lines.same_label(ref, ref) == 1.0
    with pytest.raises(ValueError, match="float's"):
        ocr_lines.same_label(ref, out[:3])


def test_score_dispatches_the_line_metrics():
    steps = [[1, 0, 2], [3, 3, 0]]
    rec = Workload("ocr_rec", "t", "lines", Path("x"), [], [], [], labels=["ab", "b"],
                   characters=CHARS)  # fmt: skip
    # against the texts, not against float: the outputs read "ab" (right) and "c" (text "b")
    assert accuracy.score(rec, _probs(steps), _probs(steps)) == {"lines": 0.5}
    cls = Workload("ocr_cls", "t", "agreement", Path("x"), [], [], [])
    ref = np.array([[0.9, 0.1], [0.2, 0.8]], np.float32)
    scores = accuracy.score(cls, ref, ref[::-1].copy())
    assert scores["agreement"] == 0.0 and set(scores) == {"agreement", "logit_sqnr_db"}


def test_logit_sqnr_is_the_sqnr_of_the_logits_behind_the_softmax():
    z_ref = np.array([[2.0, -1.0, 0.5], [0.1, 0.3, -2.0], [-3.0, 4.0, 1.0]])
    z_out = z_ref + np.array([[0.2, -0.1, 0.0], [-0.3, 0.1, 0.4], [0.0, 0.5, -0.2]])
    softmax = lambda z: np.exp(z) / np.exp(z).sum(-1, keepdims=True)  # noqa: E731
    # independent reference: the centred logits themselves, no log of probabilities
    centred = lambda z: z - z.mean(-1, keepdims=True)  # noqa: E731
    e = centred(z_out) - centred(z_ref)
    expected = 10 * np.log10(np.sum(centred(z_ref) ** 2) / np.sum(e**2))
    p_ref, p_out = softmax(z_ref).astype(np.float32), softmax(z_out).astype(np.float32)
    # float32 probabilities: log p carries ~1e-7 relative error, far below 1e-4 dB here
    assert ocr_lines.logit_sqnr_db(p_ref, p_out) == pytest.approx(expected, abs=1e-4)
    assert ocr_lines.logit_sqnr_db(p_ref, p_ref) == float("inf")
    # a shift of every logit of a sample is invisible after softmax, and to the metric
    shifted = softmax(z_out + 7.0).astype(np.float32)
    assert ocr_lines.logit_sqnr_db(p_ref, shifted) == pytest.approx(expected, abs=1e-4)


def _row(tool, config, values, default=False, key="lines"):
    return {"tool": tool, "method": config, "config": config, "default": default,
            "values": values, key: float(np.median(values))}  # fmt: skip


def test_every_peer_row_shows_signed_differences_against_ours_default_and_best():
    acc = {"metric": "lines", "repeats": 3, "rows": [
        _row("quantbridge", "default", [0.875, 0.8750, 0.8672], True),
        _row("quantbridge", "int8_avx2, mse", [0.9062, 0.8984, 0.9141]),
        _row("onnxruntime", "default", [0.50, 0.52, 0.48], True),
        _row("onnxruntime", "u8s8 per-channel percentile", [0.9141, 0.9141, 0.9141]),
        {"tool": "nncf", "method": "default", "config": "default", "default": True, "error": "x"},
    ]}  # fmt: skip
    rows = acc["rows"]
    # per repeat against ours' default: 0.875-0.50, 0.875-0.52, 0.8672-0.48 -> median +37.50
    # points [+35.50..+38.72]; ours' best is the mse row (median 0.9062)
    assert report_accuracy.vs_ours(acc, rows[2], "lines") == (
        "+37.50 points [+35.50..+38.72] / +40.62 points [+37.84..+43.41]"
    )
    # a peer ahead of ours' best is a negative difference, not hidden
    assert report_accuracy.vs_ours(acc, rows[3], "lines").endswith("-0.79 points [-1.57..+0.00]")
    assert report_accuracy.vs_ours(acc, rows[0], "lines") == "-"  # ours' own rows
    assert report_accuracy.vs_ours(acc, rows[4], "lines") == "-"  # failed: no difference
    assert report_accuracy.cell(rows[1], "lines") == "90.62 % [89.84 %-91.41 %]"
    comps = {(c["peer"], c["kind"]): c for c in verdicts.compare(acc, "lines")}
    assert comps[("onnxruntime", "best")]["status"] == "behind"
    assert comps[("nncf", "default")]["status"].startswith("peer failed")


def test_absolute_goals_are_judged_on_ours_best_int8_row():
    rec = {"metric": "lines", "rows": [
        _row("quantbridge", "default", [0.8984, 0.8906, 0.9062], True),
        _row("quantbridge", "int8_avx2, mse", [0.9141, 0.9062, 0.9219]),
    ]}  # fmt: skip
    det = {"metric": "sqnr", "rows": [_row("quantbridge", "default", [14.5], True, "sqnr_db")]}
    results = {"workloads": {"ocr_rec": {"accuracy": rec}, "ocr_det": {"accuracy": det}}}
    goals = {t[0]: t[1:] for t in verdicts.goal_targets(results)}
    measured, verdict = goals["Goal: OCR recognizer >= 91% of lines read exactly"]
    assert verdict == "met"  # 91.41 % >= 91 %
    assert measured == (
        "ours' best (int8_avx2, mse) 91.41 % [90.62-92.19]; ours' default 89.84 % [89.06-90.62]"
    )
    assert goals["Goal: OCR detector >= 20 dB SQNR"][1] == "**not met**"
    assert not any("MiniLM" in t for t in goals)  # not run: not judged


def test_classifier_rows_show_the_logit_sqnr_of_every_repeat():
    row = {"logit_sqnr_db_values": [19.35, 20.56, 19.79], "logit_sqnr_db": 20.56}
    assert report_accuracy._extra_cell("ocr_cls", row) == " | 19.79 [19.35-20.56]"
    assert report_accuracy._extra_cell("ocr_cls", {"error": "x"}) == " | -"
    assert report_accuracy._extra_cell("ocr_det", {"mask_iou": 0.9403}) == " | 0.940"
