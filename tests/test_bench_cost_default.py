"""Figure 3 (cost of quantizing) times what users get by default, and only right outputs count.

Issue 14 part 5: the cost figure timed the ``int8`` preset while ``qb.quantize``'s default is the
"default" preset (bias correction on); a time taken on a broken file must not count.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import __main__ as bench_main  # noqa: E402
from bench.suite import cost, cost_child, tools, verdicts  # noqa: E402


def _scale_model(path: Path, factor: float) -> Path:
    """y = x * factor on any NCHW float input (a stand-in for a float and a quantized file)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, "h", "w"])
    k = helper.make_tensor("k", TensorProto.FLOAT, [], [factor])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "k"], ["y"])], "g", [x], [y], [k])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_both_modes_time_the_default_first():
    assert bench_main.plan(quick=True)["cost_methods"][0] == tools.DEFAULT
    assert bench_main.plan(quick=False)["cost_methods"][0] == tools.DEFAULT
    # ORT's side of "default" is quantize_static with no options (its documented defaults)
    assert tools.ORT_OWN_DEFAULTS == {
        "activation_type": "QInt8", "weight_type": "QInt8", "per_channel": False
    }  # fmt: skip


def test_a_file_with_wrong_outputs_does_not_count(tmp_path):
    spec = {"model": "resnet18", "samples": 8, "size": 256}
    float_path = _scale_model(tmp_path / "float.onnx", 1.0)
    # 1% off: 40 dB, right; all zeros and a 2x gain (0 dB) are wrong
    near = cost._check_file(_scale_model(tmp_path / "near.onnx", 1.01), float_path, spec)
    assert near["ok"] and abs(near["sqnr_db"] - 40.0) < 1e-3
    zeros = cost._check_file(_scale_model(tmp_path / "zero.onnx", 0.0), float_path, spec)
    assert not zeros["ok"] and zeros["why"] == "all zeros"
    gain = cost._check_file(_scale_model(tmp_path / "gain.onnx", 2.0), float_path, spec)
    assert not gain["ok"] and "0.0 dB against the float file" in gain["why"]
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    assert "ORT cannot run it" in cost._check_file(broken, float_path, spec)["why"]
    assert cost_child.calibration_batches(spec)[0].shape == (8, 3, 224, 224)


def test_summary_says_why_a_method_has_no_ratio_and_default_is_judged():
    def run(seconds, repeat, error=None):
        r = {"seconds": seconds, "process_wall_s": seconds + 8, "repeat": repeat,
             "peak_mib": 100.0, "setup_peak_mib": 50.0, "steps_s": {"total_s": seconds}}  # fmt: skip
        return r | ({"error": error} if error else {})

    runs = {
        "ours/default": [run(4.0, 0)],
        "ort/default": [run(2.0, 0)],
        "ours/minmax": [run(3.0, 0, "wrong outputs: all zeros")],
        "ort/minmax": [run(2.0, 0)],
    }
    s = cost.summarize(runs, ("default", "minmax"), 0.0)
    assert s["minmax"] == {"error": "ours: wrong outputs: all zeros"}
    assert s["default"]["speedup"]["median"] == 0.5
    results = {"cost": {"workload": "resnet18", "samples": 64, "summary": s}}
    rows = {t[0]: t for t in verdicts.cost_targets(results)}
    row = rows["Cost, ResNet-18 default: in-process >= 2x faster than ORT quantize_static"]
    assert row[2] == "**not met**" and "0.50" in row[1]
    assert not any("minmax" in label for label in rows)
