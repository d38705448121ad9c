"""``examples/finetune_int8_onnx.py`` (issue 9 part 3) at a small scale: ONNX Runtime's QOperator
INT8 file of a digits-0-4 classifier is imported, gets a new head for digits 5-9, is trained with
QAT (plain loop and Lightning), and is exported as INT8 again.

Measured with the example's defaults (6 float epochs, 4 QAT epochs, seed 0): old task float 99.1%,
ORT's INT8 file 99.1%, the import 99.1%; new task before fine-tuning 13.4%, after QAT 96.9% (plain
loop; ORT on the exported file 96.9%) and 97.3% (Lightning; ORT 97.8%).
"""

from __future__ import annotations

import json

from example_modules import load_example


def test_finetune_int8_onnx_example(tmp_path, capsys):
    example = load_example("finetune_int8_onnx")
    out = tmp_path / "report.json"
    assert example.main(["--float-epochs", "3", "--epochs", "2", "--json", str(out)]) == 0
    assert "new task (digits 5-9)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    old, new = report["old_task"], report["new_task"]
    assert old["float"] >= 0.9
    # s8/s8 QOperator: the import computes what ORT's integer kernels compute (same predictions)
    assert old["imported"] == old["ort_int8_file"]
    assert new["before"] <= 0.5  # the old head does not know digits 5-9
    for name in [k for k in ("plain", "lightning") if k in new]:
        assert new[name] >= new["before"] + 0.4, (name, new)
        # the exported QDQ file in ORT: the same predictions up to a few tie-breaking images
        assert abs(new[f"{name}_ort"] - new[name]) <= 0.02, (name, new)
