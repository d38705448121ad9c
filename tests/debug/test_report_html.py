"""The HTML report: self-contained (no network resource), values escaped, and rendered by a real
headless Chromium with its charts drawn and no console error.

The inputs are hand-made dicts in the JSON shapes of ``quantbridge.compare/1`` and
``quantbridge.sensitivity/1`` (the producer of the first is ``qb.compare``). Chromium is the
Debian package ``chromium``; the fixture installs it with apt-get when it is missing and the
tests run as root (``.ci/run`` does the same), and skips with the reason otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from quantbridge.debug import render_html

PIL = pytest.importorskip("PIL.Image")

ENGINES = ["torch-quant", "ort-ref", "ort", "openvino"]


def _pair(a: str, b: str, sqnr: float | None, spread: int, cls: str) -> dict:
    hist = [[k, int(1000 * np.exp(-(k * k) / (2 * spread * spread + 1e-9)))] for k in range(-8, 9)]
    total = sum(c for _, c in hist)
    share = {
        "0": hist[8][1] / total,
        "1": (hist[7][1] + hist[9][1]) / total,
        "2": (hist[6][1] + hist[10][1]) / total,
    }
    share[">2"] = 1.0 - sum(share.values())
    return {
        "a": a, "b": b, "sqnr_db": sqnr, "cosine": 0.999, "max_abs": 0.05, "mean_abs": 0.001,
        "lsb_share": share, "lsb_hist": hist, "class": cls,
    }  # fmt: skip


def compare_dict() -> dict:
    tensors = []
    for i in range(24):
        diverged = i >= 15
        tensors.append(
            {
                "name": f"layer{i}/conv_out" if i != 3 else "<script>alert(1)</script>",
                "order": i, "op": "Conv", "layer": f"layer{i}", "scale": 0.02, "zero_point": 0,
                "pairs": [
                    _pair("ort-ref", "ort", 18.0 if diverged else None, 3 if diverged else 0,
                          "divergence" if diverged else "exact"),
                    _pair("ort-ref", "openvino", 45.0 - i, 1, "rounding"),
                    _pair("ort-ref", "torch-quant", 60.0 - 0.5 * i, 0, "rounding"),
                ],
            }
        )  # fmt: skip
    return {
        "schema": "quantbridge.compare/1",
        "models": ["model.onnx", "model.int8.onnx"],
        "engines": ENGINES,
        "reference": "ort-ref",
        "errors": {"tensorrt": "no GPU and no tensorrt package"},
        "unmatched": {"openvino": ["fused_bn_3"]},
        "tensors": tensors,
        "first_divergence": {
            "name": "layer15/conv_out",
            "order": 15,
            "a": "ort-ref",
            "b": "ort",
            "max_lsb": 7.0,
        },  # fmt: skip
    }


def sensitivity_dict() -> dict:
    layers = [
        {"name": "fc2", "op": "Linear", "only_this_quantized": 0.95,
         "all_but_this_quantized": 0.9999, "rank": 1},
        {"name": "fc3", "op": "Linear", "only_this_quantized": 0.9999,
         "all_but_this_quantized": 0.959, "rank": 2},
        {"name": "", "op": "(top-level ops)", "only_this_quantized": 0.99995,
         "all_but_this_quantized": 0.9589, "rank": 3},
    ]  # fmt: skip
    return {
        "schema": "quantbridge.sensitivity/1", "metric": "cosine",
        "baseline": {"float": 1.0, "quantized": 0.9589}, "layers": layers, "budget": 0.999,
        "keep_float": ["fc2", "fc3"], "wider": {}, "achieved": 0.99996,
    }  # fmt: skip


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_report_is_self_contained_and_escaped():
    page = render_html(compare_dict(), sensitivity_dict())
    parser = _Collect()
    parser.feed(page)
    tags = parser.tags
    # no resource is fetched: no src/href attribute anywhere, no url(...) in the CSS
    assert not [(t, a) for t, a in tags if "src" in a or "href" in a]
    assert "url(" not in page and "http" not in page.replace("http://www.w3.org", "")
    # the tensor named like a script tag is text, not a script: only our own script exists
    assert sum(1 for t, _ in tags if t == "script") == 1
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    ids = {a.get("id") for _, a in tags}
    assert {"sqnr-chart", "sensitivity-chart", "first-divergence", "worst-tensors"} <= ids
    # one polyline per engine pair, one histogram per worst tensor (at most 6)
    assert sum(1 for t, _ in tags if t == "polyline") == 3
    assert sum(1 for t, a in tags if t == "svg" and a.get("class") == "lsb-hist") == 6
    assert "layer15/conv_out" in page and "max 7 LSB" in page


def test_report_sections_follow_the_inputs():
    only_sens = render_html(None, sensitivity_dict())
    assert "sensitivity-chart" in only_sens and "sqnr-chart" not in only_sens
    only_cmp = render_html(compare_dict(), None)
    assert "sqnr-chart" in only_cmp and "sensitivity-chart" not in only_cmp
    with pytest.raises(ValueError, match="needs a compare result"):
        render_html(None, None)
    with pytest.raises(ValueError, match="schema"):
        render_html({"schema": "something/1"}, None)


# -- headless Chromium -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, timeout=900
        )
        exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install -y chromium)")
    return exe


def _chromium(exe: str, page: Path, *mode: str) -> subprocess.CompletedProcess:
    args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
            "--v=0", "--window-size=1200,1400", *mode, page.as_uri()]  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def _console_errors(stderr: str) -> list[str]:
    """Console messages Chromium logs on stderr for page errors (uncaught exceptions,
    console.error): lines with ``CONSOLE`` and an error, or ``Uncaught``."""
    return [
        line
        for line in stderr.splitlines()
        if "Uncaught" in line or re.search(r"(ERROR|SEVERE):CONSOLE|CONSOLE.*[Ee]rror", line)
    ]


def test_chromium_renders_the_charts(chromium, tmp_path):
    page = tmp_path / "report.html"
    page.write_text(render_html(compare_dict(), sensitivity_dict()))
    shot = tmp_path / "shot.png"
    run = _chromium(chromium, page, f"--screenshot={shot}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert _console_errors(run.stderr) == []
    pixels = np.asarray(PIL.open(shot).convert("RGB"), dtype=np.float64)
    assert pixels.shape[:2] == (1400, 1200)
    assert pixels.std() > 20  # not blank: a white page has std 0
    # the chart colours are on screen: the first pair's line and the sensitivity bars (blue)
    blue = np.all(np.abs(pixels - [0x1F, 0x77, 0xB4]) < 8, axis=2).sum()
    orange = np.all(np.abs(pixels - [0xFF, 0x7F, 0x0E]) < 8, axis=2).sum()
    assert blue > 200 and orange > 200, (blue, orange)

    dom = _chromium(chromium, page, "--dump-dom")
    assert dom.returncode == 0 and _console_errors(dom.stderr) == []
    assert 'data-ready="1"' in dom.stdout  # the inline script ran to its end
    sqnr = re.search(r'<svg id="sqnr-chart".*?</svg>', dom.stdout, re.S)
    assert sqnr is not None and sqnr.group(0).count("<circle") == 3 * 24


def test_chromium_check_sees_a_script_error(chromium, tmp_path):
    """The console check can fail: a page with an uncaught error is caught by it."""
    page = tmp_path / "broken.html"
    page.write_text(render_html(None, sensitivity_dict()).replace(
        "<script>", "<script>undefinedFunction();</script><script>", 1
    ))  # fmt: skip
    run = _chromium(chromium, page, "--dump-dom")
    assert _console_errors(run.stderr), run.stderr[-2000:]
