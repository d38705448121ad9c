"""Why the peers read 0-9% of PP-OCRv4 rec's lines in stop 12's bench (issue 14): by hand.

``python -m bench.ocr_peers_study ort [--eval 32]``: ONNX Runtime ``quantize_static`` on the
recognizer with the bench's data (``bench/suite/ocr_lines``: 16 calibration lines, evaluation
lines from their own seeds), file as given and after ``quant_pre_process`` with each of its
documented options, ORT's defaults and its u8/s8 per-channel form (opset 12 and 13), then the
default's candidate causes on one calibration (op types, activation type, per-channel alone).
``... layers``: per-tensor int8 weights (ORT's ``QInt8`` default: symmetric, max-abs) on one
weighted layer at a time, every other layer float. ``... nncf``: NNCF's default and ``mixed``
(``QB_BENCH_NNCF_PYTHON``) on the file as given, at opset 13, and prepared (``peer_prep``). Each
line prints lines read exactly, fused / node by node (``--ov``: also in OpenVINO).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from bench.suite import accuracy, engines, ocr_lines, peer_child, peer_prep, tools, workloads

ROOT = Path(__file__).resolve().parents[1]
ORT_DEFAULT = {"activation_type": "QInt8", "weight_type": "QInt8", "per_channel": False}
X86 = {"activation_type": "QUInt8", "weight_type": "QInt8", "per_channel": True, "opset13": True}


class Lines:
    """The recognizer, its calibration feeds and a scorer (lines read exactly)."""

    def __init__(self, n_eval: int, ov: bool):
        self.path = workloads.ocr_det_path().with_name("ch_PP-OCRv4_rec_infer.onnx")
        calib, _ = ocr_lines.rec_lines(ocr_lines.CALIB_SEEDS, 16)
        self.x, self.texts = ocr_lines.rec_lines(ocr_lines.EVAL_SEEDS[0], n_eval)
        self.chars = ocr_lines.characters(self.path)
        self.feeds = ocr_lines.batches(calib, 4, "x")
        self.ov = ov

    def read(self, path: Path, optimize: bool = True) -> float:
        session = engines.ort_session(path, optimize=optimize)
        out = engines.ort_outputs(session, ocr_lines.batches(self.x, 16, "x"))
        return ocr_lines.lines_read(out, self.texts, self.chars)

    def line(self, name: str, path: Path) -> str:
        try:
            text = f"{self.read(path):.4f} / {self.read(path, optimize=False):.4f}"
        except Exception as e:  # a file ORT refuses is a result
            return f"{name}: {tools.short_error(e)}"
        if self.ov:
            compiled = engines.ov_compile(path, "f32")
            out = np.concatenate(
                [compiled({"x": self.x[i : i + 16]})[0] for i in range(0, len(self.x), 16)]
            )
            text += f", OpenVINO {ocr_lines.lines_read(out, self.texts, self.chars):.4f}"
        return f"{name}: {text}"


def _pre_processed(src: Path, tmp: Path) -> dict[str, Path]:
    from onnxruntime.quantization.shape_inference import quant_pre_process

    out = {}
    for options in peer_prep.PRE_PROCESS_OPTIONS:
        label = ",".join(options) or "defaults"
        try:
            quant_pre_process(str(src), str(tmp / f"pre.{label}.onnx"), **options)
            out[label] = tmp / f"pre.{label}.onnx"
        except Exception as e:
            print(f"quant_pre_process({label}): {tools.short_error(e)}", flush=True)
        finally:  # a failed symbolic shape inference leaves it in the working directory
            Path("sym_shape_infer_temp.onnx").unlink(missing_ok=True)
    return out


def _opset13(src: Path, dst: Path) -> Path:
    onnx.save(peer_prep.upgrade_opset(onnx.load(str(src)))[0], str(dst))
    return dst


def ort(lines: Lines, tmp: Path) -> None:
    print(lines.line("float", lines.path), flush=True)
    sources = {"as given": lines.path, **_pre_processed(lines.path, tmp)}
    for label, src in list(sources.items()):
        if label != "as given":
            sources[f"{label} + opset 13"] = _opset13(src, tmp / f"{label}.13.onnx")
    for label, src in sources.items():
        for name, settings in (("default", ORT_DEFAULT), ("u8s8 per-channel", X86)):
            out = tmp / "q.onnx"
            try:
                tools.quantize_ort(src, lines.feeds, "minmax", out, settings=settings)
            except Exception as e:
                print(f"{label}, {name}: {tools.short_error(e)}", flush=True)
                continue
            print(lines.line(f"{label}, {name}", out), flush=True)
    # the default's 0%: which part of "default" does it (the last pre-processed opset-13 file)
    src = sources[next(k for k in reversed(sources) if k.endswith("opset 13"))]
    for name, extra in (
        ("default, Conv/MatMul only", {"op_types_to_quantize": ["Conv", "MatMul", "Gemm"]}),
        ("default, uint8 activations", {"activation_type": "QUInt8"}),
        ("default, per_channel=True", {"per_channel": True}),
    ):
        tools.quantize_ort(src, lines.feeds, "minmax", tmp / "q.onnx", settings=ORT_DEFAULT | extra)
        print(lines.line(name, tmp / "q.onnx"), flush=True)


def layers(lines: Lines, tmp: Path) -> None:
    """Per-tensor symmetric int8 weights on one layer at a time (ORT's QInt8 weights)."""
    model = onnx.load(str(lines.path))
    peer_prep.constants_to_initializers(model)
    index = {t.name: i for i, t in enumerate(model.graph.initializer)}
    results = []
    for node in model.graph.node:
        if node.op_type not in ("Conv", "MatMul", "Gemm") or node.input[1] not in index:
            continue
        slot = model.graph.initializer[index[node.input[1]]]
        w = numpy_helper.to_array(slot)
        step = np.abs(w).max() / 127
        fake = (np.clip(np.round(w / step), -127, 127) * step).astype(w.dtype)
        slot.CopyFrom(numpy_helper.from_array(fake, slot.name))
        onnx.save(model, str(tmp / "one.onnx"))
        results.append((lines.read(tmp / "one.onnx", optimize=False), node.name))
        slot.CopyFrom(numpy_helper.from_array(w, slot.name))
        print(f"{node.name}: {results[-1][0]:.4f}", flush=True)
    print("worst:", sorted(results)[:4])


def nncf(lines: Lines, tmp: Path) -> None:
    python = os.environ.get("QB_BENCH_NNCF_PYTHON") or os.environ.get("QB_BENCH_PEERS_PYTHON")
    prepared = tmp / "prepared.onnx"
    peer_prep.prepare(lines.path, prepared)
    sources = {"as given": lines.path, "opset 13": _opset13(lines.path, tmp / "o13.onnx"),
               "prepared (peer_prep)": prepared}  # fmt: skip
    npz = tmp / "calib.npz"
    peer_child.save_batches(npz, lines.feeds)
    for label, src in sources.items():
        for config in ("default", "mixed"):
            out = tmp / "nncf.onnx"
            spec = {"tool": "nncf", "config": config, "float_onnx": str(src), "calib": str(npz),
                    "out": str(out)}  # fmt: skip
            proc = subprocess.run([python or "python", "-m", "bench.suite.peer_child", json.dumps(spec)],
                                  cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                  capture_output=True, text=True)  # fmt: skip
            if proc.returncode:
                print(f"{label}, {config}: failed {proc.stderr.strip()[-300:]}", flush=True)
                continue
            census = accuracy.weighted_inputs(out) | accuracy.ort_compute(out)
            print(lines.line(f"{label}, nncf {config}", out), census, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.ocr_peers_study", description=__doc__)
    p.add_argument("what", choices=("ort", "layers", "nncf"))
    p.add_argument("--eval", type=int, default=32, help="evaluation lines")
    p.add_argument("--ov", action="store_true", help="also read the INT8 files in OpenVINO")
    args = p.parse_args()
    lines = Lines(args.eval, args.ov)
    with tempfile.TemporaryDirectory(prefix="qb-ocr-peers-") as tmp:
        {"ort": lambda: ort(lines, Path(tmp)), "layers": lambda: layers(lines, Path(tmp)),
         "nncf": lambda: nncf(lines, Path(tmp))}[args.what]()  # fmt: skip


if __name__ == "__main__":
    main()
