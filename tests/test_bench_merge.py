"""Rows measured after a bench run, merged into its results (``bench/suite/merge.py``).

Hand-made results: a replaced row must change the verdict the report prints, a new row must join
ours' best, and the header must say which rows were measured later, at which version. A rows file
with another number of calibration repeats, or for a workload the run did not measure, is refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.__main__ import main as bench_main  # noqa: E402
from bench.suite import machine, merge, report, verdicts  # noqa: E402


def _row(tool, config, values, default=False):
    return {"tool": tool, "method": config, "config": config, "default": default,
            "values": values, "sqnr_db": sorted(values)[len(values) // 2]}  # fmt: skip


def _run():
    rows = [
        _row("quantbridge", "default", [15.0, 15.2, 15.4], default=True),
        _row("nncf", "default", [14.0, 14.1, 14.2], default=True),
        _row("nncf", "mixed", [19.0, 19.3, 19.4]),
    ]
    accuracy = {"metric": "sqnr", "repeats": 3, "rows": rows}
    return {"workloads": {"ocr_det": {"title": "Detector", "notes": [], "accuracy": accuracy}}}


def _whole_run():
    """``_run`` with what the report's header reads (this machine's description)."""
    return {**_run(), "command": "python -m bench --quick", "mode": "quick",
            "started": "2026-12-01", "machine": {**machine.describe(ROOT), "priority": "off"}}  # fmt: skip


def _added(rows, repeats=3, workload="ocr_det"):
    return {"command": "python -m bench.peer_rows ocr_det --tools quantbridge",
            "finished": "2026-12-01 23:59:00 UTC", "load_average": [3.0, 3.0, 3.0],
            "git": {"commit": "abc1234", "branch": "main", "library_modified": False},
            "workload": workload, "repeats": repeats, "metric": "sqnr", "rows": rows}  # fmt: skip


def _best_verdict(results):
    (row,) = [t for t in verdicts.accuracy_targets(results) if "best" in t[0]]
    return row


def test_a_new_row_joins_ours_best_and_flips_the_verdict():
    results = _run()
    assert _best_verdict(results)[2] == "**not met**"  # 15.2 < 19.3
    names = merge.add_rows(results, _added([_row("quantbridge", "split", [20.1, 20.2, 20.4])]))
    assert names == ["quantbridge/split"]
    rows = results["workloads"]["ocr_det"]["accuracy"]["rows"]
    assert [r["config"] for r in rows] == ["default", "default", "mixed", "split"]
    assert rows[-1]["added"]["git"]["commit"] == "abc1234"
    assert _best_verdict(results)[2] == "met"


def test_a_row_of_the_same_tool_and_configuration_is_replaced():
    results = _run()
    merge.add_rows(results, _added([_row("quantbridge", "default", [16.0, 16.1, 16.2], True)]))
    rows = results["workloads"]["ocr_det"]["accuracy"]["rows"]
    assert len(rows) == 3
    assert rows[0]["values"] == [16.0, 16.1, 16.2] and "added" in rows[0]
    # the default verdict now compares 16.x with NNCF's 14.x, repeat by repeat: +2.0 dB each
    (default,) = [t for t in verdicts.accuracy_targets(results) if "default" in t[0]]
    assert default[2] == "met"


def test_the_header_says_which_rows_were_measured_later():
    results = _whole_run()
    merge.add_rows(results, _added([_row("quantbridge", "split", [20.1, 20.2, 20.4])]))
    text = report.render(results)
    assert "merged in (`--add`): ocr_det: `quantbridge/split`" in text
    assert "main@abc1234" in text and "load average 3.0" in text


def test_refused_rows_name_the_file_and_the_fix():
    with pytest.raises(
        ValueError, match=r"x\.json: 1 calibration repeats, the run has 3; .*--repeats 3"
    ):
        merge.add_rows(_run(), _added([], repeats=1), source="x.json")
    with pytest.raises(
        ValueError, match=r"workload 'minilm' has no accuracy figure .*\['ocr_det'\]"
    ):
        merge.add_rows(_run(), _added([], workload="minilm"))
    with pytest.raises(ValueError, match="not a `python -m bench.peer_rows` file"):
        merge.add_rows(_run(), {"rows": []})


def test_render_with_add_writes_the_merged_report(tmp_path):
    run = _whole_run()
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "rows.json").write_text(
        json.dumps(_added([_row("quantbridge", "split", [20.1, 20.2, 20.4])]))
    )
    md = tmp_path / "B.md"
    argv = ["--render", str(tmp_path / "run.json"), "--add", str(tmp_path / "rows.json")]
    assert bench_main([*argv, "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "`quantbridge/split`" in text and "20.20" in text
    with pytest.raises(SystemExit):  # --add without --render: nothing to merge into
        bench_main(["--add", str(tmp_path / "rows.json")])


def test_a_partial_run_replaces_whole_workloads_and_the_cost_figure():
    results = {**_run(), "mode": "quick", "plan": {"repeats": 3}, "cost": {"old": True}}
    part = _run()
    part["workloads"]["ocr_det"]["accuracy"]["rows"][1] = _row("nncf", "default", [16.0] * 3, True)
    part |= {"mode": "quick", "plan": {"repeats": 3}, "cost": {"new": True},
             "command": "python -m bench --quick --only ocr_det", "started": "2026-12-01 23:50",
             "machine": {"git": {"commit": "def5678"}, "load_average_end": [2.0, 2.0, 2.0]}}  # fmt: skip
    assert merge.add_run(results, part) == ["ocr_det", "cost figure"]
    assert results["cost"] == {"new": True}
    (default,) = [t for t in verdicts.accuracy_targets(results) if "default" in t[0]]
    assert default[2] == "**not met**"  # NNCF's default now 16.0 > ours' 15.x
    assert results["added_rows"][-1]["git"]["commit"] == "def5678"
    with pytest.raises(ValueError, match="a 'full' run cannot replace parts of a 'quick' run"):
        merge.add_run(results, {**part, "mode": "full"})
    with pytest.raises(ValueError, match="1 calibration repeats, the run has 3"):
        merge.add_run(results, {**part, "plan": {"repeats": 1}})


def test_a_partial_run_keeps_the_figures_it_did_not_run():
    # `--figures accuracy` measures no speed: the run's speed figure of that workload stays,
    # its accuracy rows are replaced
    results = {**_run(), "mode": "quick", "plan": {"repeats": 3}}
    results["workloads"]["ocr_det"]["speed"] = {"batch 1": {"kept": True}}
    part = _run()
    part["workloads"]["ocr_det"]["accuracy"]["rows"][1] = _row("nncf", "default", [16.0] * 3, True)
    part |= {"mode": "quick", "plan": {"repeats": 3}, "command": "python -m bench --quick",
             "started": "2026-12-02 04:50", "machine": {}}  # fmt: skip
    assert merge.add_run(results, part) == ["ocr_det"]
    entry = results["workloads"]["ocr_det"]
    assert entry["speed"] == {"batch 1": {"kept": True}}
    assert entry["accuracy"]["rows"][1]["tool"] == "nncf"
    assert entry["accuracy"]["rows"][1] == part["workloads"]["ocr_det"]["accuracy"]["rows"][1]


def test_a_part_from_another_isa_is_named_in_the_header():
    # accuracy measured on an AVX2-only machine merged into a VNNI run: the header must say so
    # (ONNX Runtime's u8s8 kernels saturate pair sums without VNNI, so the numbers differ)
    results = {**_whole_run(), "mode": "quick", "plan": {"repeats": 3}}
    results["machine"]["isa"] = {"avx2": True, "avx512_vnni": True}
    part = _run()
    part |= {"mode": "quick", "plan": {"repeats": 3}, "command": "python -m bench --quick",
             "started": "2026-12-02 16:00",
             "machine": {"isa": {"avx2": True, "avx512_vnni": False}}}  # fmt: skip
    merge.add_run(results, part)
    assert results["added_rows"][-1]["isa_differs"] == ["avx512_vnni no (run: yes)"]
    text = report.render(results)
    assert "**on another machine's ISA**: avx512_vnni no (run: yes)" in text
    same = {**part, "machine": {"isa": {"avx2": True, "avx512_vnni": True}}}
    merge.add_run(results, same)
    assert results["added_rows"][-1]["isa_differs"] == []
