"""``quantbridge compare``: the table, the JSON file, one-line errors."""

from __future__ import annotations

import json

import numpy as np

from quantbridge.cli import main


def test_cli_writes_the_compare_json(cnn, tmp_path, capsys):
    path, _, inputs = cnn
    samples = tmp_path / "samples.npz"
    np.savez(samples, **inputs)
    out = tmp_path / "out.json"
    code = main([
        "compare", str(path), "--inputs", str(samples), "--engines", "ort-ref,ort,integer",
        "--json", str(out),
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert "first divergence: none" in printed and "reference engine: ort-ref" in printed
    data = json.loads(out.read_text())
    assert data["schema"] == "quantbridge.compare/1"
    assert data["engines"] == ["ort-ref", "ort", "integer"] and data["errors"] == {}
    assert data["models"] == [str(path)]
    for t in data["tensors"]:
        assert set(t) == {"name", "order", "op", "layer", "scale", "zero_point", "output", "pairs"}
        for p in t["pairs"]:
            assert {"a", "b", "sqnr_db", "cosine", "max_abs", "mean_abs", "lsb_share",
                    "lsb_hist", "class"} <= set(p)  # fmt: skip


def test_cli_bad_inputs_fail_in_one_line(cnn, tmp_path, capsys):
    path, _, inputs = cnn
    samples = tmp_path / "wrong.npz"
    np.savez(samples, image=inputs["x"])
    assert main(["compare", str(path), "--inputs", str(samples)]) == 2
    err = capsys.readouterr().err
    assert "quantbridge compare: error:" in err and "['x']" in err and len(err.splitlines()) == 1
    assert main(["compare", str(tmp_path / "missing.onnx"), "--inputs", str(samples)]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_report_writes_the_html_of_this_comparison(cnn, tmp_path, capsys):
    """``--report`` renders this run's JSON: every engine pair and tensor appear, inline SVG only."""
    path, _, inputs = cnn
    samples = tmp_path / "samples.npz"
    np.savez(samples, **inputs)
    out, report = tmp_path / "out.json", tmp_path / "r.html"
    code = main([
        "compare", str(path), "--inputs", str(samples), "--engines", "ort-ref,ort",
        "--json", str(out), "--report", str(report),
    ])  # fmt: skip
    assert code == 0 and f"wrote {report}" in capsys.readouterr().out
    html = report.read_text()
    data = json.loads(out.read_text())
    assert "<svg" in html and "http://" not in html.replace("http://www.w3.org", "")
    assert "src=" not in html  # self-contained: nothing loaded from anywhere
    for t in data["tensors"]:
        assert t["name"] in html
