"""``examples/lowbit_qat.py`` (issue #3 part 6), reduced: 2-bit weights, 2 QAT epochs.

Measured with this reduced run (float 8 epochs, seeds 0-3 of the split and training;
``python examples/lowbit_qat.py --epochs 2 --bits 2 --seed S``, 2026-12-01):

======  =====  =====  ==============  ===========
seed    float  PTQ    QAT moving avg  QAT LSQ
======  =====  =====  ==============  ===========
0       99.3   71.8   97.1            97.3
1       99.1   48.7   98.2            98.4
2       98.4   67.3   97.6            97.6
3       98.7   66.7   98.2            98.4
======  =====  =====  ==============  ===========

QAT beats PTQ by 25.3 to 49.5 points (moving average) and 25.6 to 49.8 (LSQ); the test asks
for 15 for both (seed 0). Since ``freeze_batchnorm`` moves ``|k|`` into LSQ's learned
``log_scale`` too (regression test in tests/torch/test_qat.py), LSQ no longer trails: it
matches or beats the moving average by 0.0-0.2 points; the test allows it 1 point (4 of 450
images) below. ONNX Runtime runs the exported QAT models at the torch accuracy (identical in
every run above; 0.5 points allowed).
"""

from __future__ import annotations

import json

import pytest
from example_modules import load_example


@pytest.mark.slow
def test_qat_recovers_2bit_weight_accuracy_that_ptq_loses(tmp_path, capsys):
    example = load_example("lowbit_qat")
    out = tmp_path / "lowbit.json"
    assert example.main(["--epochs", "2", "--bits", "2", "--json", str(out)]) == 0
    assert "int2" in capsys.readouterr().out  # the table
    report = json.loads(out.read_text())
    (r,) = report["bits"]
    assert (r["bits"], r["qmin"], r["qmax"]) == (2, -1, 1)
    assert report["float"] >= 0.97
    assert report["float"] - r["ptq"] >= 0.15  # 2-bit PTQ clearly loses (measured 26.9 points)
    assert r["qat_moving_average"] - r["ptq"] >= 0.15
    assert r["qat_lsq"] - r["ptq"] >= 0.15  # was 0.05 while LSQ lost accuracy in the BN fold
    assert r["qat_lsq"] >= r["qat_moving_average"] - 0.01
    assert abs(r["ort_moving_average"] - r["qat_moving_average"]) <= 0.005
    assert abs(r["ort_lsq"] - r["qat_lsq"]) <= 0.005
    # ternary weights in int8 containers: every stored code in [-1, 1], and all of them used
    assert r["weight_codes"] and all(-1 <= lo and hi <= 1 for lo, hi in r["weight_codes"].values())
    assert any(lo == -1 and hi == 1 for lo, hi in r["weight_codes"].values())
