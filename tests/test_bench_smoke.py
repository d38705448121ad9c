"""The benchmark harness keeps working: ``python -m bench`` on its smallest workload, in process.

Nothing here asserts on time (the machine is shared); the full suite's numbers live in
BENCHMARKS.md. The run covers figure 1 on digits (ours, ONNX Runtime ``quantize_static``,
PyTorch FX); the report renderer is also checked on a hand-made results dict with every figure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    from bench.__main__ import main

    out = tmp_path_factory.mktemp("bench")
    args = ["--quick", "--only", "digits", "--figures", "accuracy"]
    args += ["--json", str(out / "r.json"), "--markdown", str(out / "r.md")]
    assert main(args) == 0
    return json.loads((out / "r.json").read_text()), (out / "r.md").read_text()


def test_digits_rows_from_every_tool(digits_run):
    results, _ = digits_run
    acc = results["workloads"]["digits"]["accuracy"]
    tools = {r["tool"]: r for r in acc["rows"] if r.get("default")}  # each tool's default row
    assert set(tools) == {"quantbridge", "onnxruntime", "nncf", "modelopt", "pytorch_fx"}
    for row in acc["rows"]:
        if row["tool"] in ("nncf", "modelopt") and "error" in row:
            # not installed here (QB_BENCH_PEERS_PYTHON names an environment that has them):
            # a failed row that says why, never a win
            assert "No module named" in row["error"], row
            continue
        assert "error" not in row, row
        assert 0.0 <= row["top1"] <= 1.0 and len(row["values"]) == acc["repeats"]
    assert acc["float"]["top1"] > 0.85  # 3 epochs already learn the digits
    assert abs(tools["quantbridge"]["top1"] - acc["float"]["top1"]) <= 0.03


def test_machine_description_and_report(digits_run):
    results, text = digits_run
    machine = results["machine"]
    assert machine["logical_cpus"] >= 1 and isinstance(machine["isa"], (list, dict, str))
    assert machine["versions"]["onnxruntime"] and machine["versions"]["torch"]
    assert text.startswith("# quantbridge benchmarks")
    assert "## Machine" in text and "## 1. Accuracy" in text and "| top-1 |" in text


def test_report_renders_every_figure():
    from bench.suite import report
    from bench.suite.timing import paired_ratio

    r = paired_ratio([10.0, 12.0, 11.0], [30.0, 33.0, 36.0])
    assert r["max"] < 1 and r["min"] > 0 and r["n"] == 3
    stat = {"median": 1.0, "min": 0.5, "max": 2.0, "n": 3}
    speed = {
        "models": {},
        "openvino": "ok",
        "openvino_float_default": "bf16",
        "ops": {"ort/ours": {"QLinearConv": 20}},
        "batches": {
            "batch 8": {
                "ms": {"ort/float": stat, "ort/ours": stat},
                "cpu_ms": {"ort/float": stat, "ort/ours": stat},
                "ratios": {"ort/float : ort/ours": {"what": "speed-up", **r}},
            }
        },
    }
    cost_method = {
        "ours_s": stat, "ort_s": stat, "ours_peak_mib": stat, "ort_peak_mib": stat,
        "ours_setup_peak_mib": 1.0, "ort_setup_peak_mib": 1.0,
        "ours_steps_s": {"calibrate_s": 1.0, "export_s": 1.0},
        "speedup": r, "speedup_incl_float_export": r, "memory_ratio": r,
    }  # fmt: skip
    results = {
        "mode": "quick",
        "command": "python -m bench",
        "started": "now",
        "total_seconds": 1.0,
        "machine": {
            "cpu": "x",
            "isa": {"avx512_vnni": True},
            "logical_cpus": 2,
            "usable_cpus": 2,
            "memory_gib": 1,
            "os": "linux",
            "python": "3",
            "versions": {"torch": "2"},
            "git": {},
            "priority": "off",
        },  # fmt: skip
        "workloads": {"resnet18": {"title": "ResNet", "notes": [], "speed": speed}},
        "cost": {
            "model": "ResNet",
            "samples": 8,
            "batch": 8,
            "repeats": 1,
            "float_export_s": 1.0,
            "summary": {"percentile": cost_method},
        },  # fmt: skip
        "qat": {"pending": "not yet"},
    }
    text = report.render(results)
    for heading in ("## Targets", "## 2. Speed", "## 3. Cost", "## 4. QAT"):
        assert heading in text
    assert "ours >= 3x faster than float" in text
    assert "Incomplete run" not in text and "written again" not in text
    # a run stopped after a stage, rendered again by a later checkout, with its load sampled
    results["machine"] |= {"git": {"commit": "abc", "branch": "bench", "library_modified": False},
                           "load_samples": {"period_s": 30, "n": 3, "min": 1.0, "median": 2.0,
                                            "max": 9.5}}  # fmt: skip
    results |= {"incomplete": "resnet18", "stage_seconds": {"resnet18": 5.0},
                "rendered": {"at": "later", "json": "r.json", "git": {"commit": "def"}}}  # fmt: skip
    text = report.render(results)
    assert "**Incomplete run**: stopped after stage `resnet18`; stages done: resnet18." in text
    assert (
        "`python -m bench --render r.json` at git def from that run's numbers (measured at git bench@abc)"
        in text
    )
    assert "sampled every 30 s: min 1.0, median 2.0, max 9.5 (3 samples)" in text


def test_interleave_takes_the_fastest_of_calls_per_sample():
    """Samples are the best of ``k`` calls, ``k`` from the warm-up (counted, not timed: the
    runner's own call counter shows how many calls each round made)."""
    from bench.suite.timing import calls_per_sample, interleave

    assert calls_per_sample(6.5, 40.0, 5) == 5  # ResNet-18 batch 1: best of 5
    assert calls_per_sample(12.0, 40.0, 5) == 4
    assert calls_per_sample(80.0, 40.0, 5) == 1  # batch 8 and larger: single calls
    assert calls_per_sample(0.0, 40.0, 5) == 5  # a no-op runner: as many as allowed

    made = {"a": 0}

    def runner():
        made["a"] += 1

    out = interleave({"a": runner}, rounds=3, warmup=2, gap_s=0.0, max_calls=4)
    assert out["a"]["calls"] == 4  # a no-op is far below 40 ms
    assert made["a"] == 2 + 3 * 4 and len(out["a"]["wall_ms"]) == 3
