"""Issue 14 part 5: the PP-OCRv4 detector's INT8 in OpenVINO against OpenVINO's own float.

    python -m bench.ov_layout                       # 1x3x480x480 (the suite's OCR size), 8 images
    python -m bench.ov_layout --size 640 --rounds 20 --no-nncf

Forms, all run by OpenVINO (CPU, 2 threads, 1 stream, LATENCY; ``bench.suite.engines``):

* ``float``: the float ONNX file at OpenVINO's default precision (f32 on a CPU without bf16);
* ``ours``: ``qb.import_onnx`` + ``qb.quantize`` (``--recipe``, default ``native``: 7-bit weights
  where the u8 x s8 kernels saturate) + ``qb.export``: the QDQ layout ONNX Runtime fuses;
* ``ours_ov``: the same file through ``qb.openvino_layout`` (Q/DQ pairs only at the inputs
  OpenVINO runs in int8, integer constants of element-wise ops as floats);
* ``nncf_ov``: NNCF's ``nncf.quantize`` (preset PERFORMANCE, same calibration images) on the
  OpenVINO model of the float file (``ov.convert_model``): NNCF's own OpenVINO path, the known-good
  INT8 layout. Run in the peers' interpreter (``QB_BENCH_PEERS_PYTHON``); ``--no-nncf`` skips it.
  (NNCF's ONNX-in/ONNX-out result computes zeros in OpenVINO here; see ``qb.openvino_layout``.)

Before a time counts each form's output is checked against ONNX Runtime node by node on the same
file (NNCF's IR: against float) with the suite's threshold (``speed.check_output``), and its SQNR
against float is printed. Then one interleaved loop times every form (``timing.interleave``, same
calls per sample) and the bench prints median [min-max] ms and per-round ratios float / form
(above 1: the INT8 form is faster). ``--perf`` adds OpenVINO's per-layer-type time (PERF_COUNT)
and each form's runtime layer census (layer type : runtime precision).
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.suite.accuracy import sqnr_db

ROOT = Path(__file__).resolve().parents[1]

NNCF_CHILD = """
import sys, json, time
import nncf, openvino as ov
sys.path.insert(0, {root!r})
from bench.suite.peer_child import load_batches
spec = json.loads(sys.argv[1])
batches = load_batches(spec["calib"])
model = ov.convert_model(spec["float_onnx"])
t0 = time.perf_counter()
q = nncf.quantize(model, nncf.Dataset(batches), subset_size=len(batches),
                  preset=nncf.QuantizationPreset.PERFORMANCE)
seconds = time.perf_counter() - t0
ov.save_model(q, spec["out"])
print(json.dumps({{"seconds": seconds, "version": nncf.__version__}}))
"""


def _feeds(det: Path, size: int, calib: int) -> tuple[list, dict]:
    import onnx

    from bench.suite import ocr_data

    name = onnx.load(str(det), load_external_data=False).graph.input[0].name
    batches = [{name: ocr_data.batch([i], size)} for i in range(calib)]
    return batches, {name: ocr_data.batch([10_000], size)}


def _ours(det: Path, batches: list, recipe: str, work: Path) -> tuple[Path, Path, dict]:
    import torch

    import quantbridge as qb
    from bench.suite import tools

    calib = [{k: torch.from_numpy(v) for k, v in b.items()} for b in batches]
    path = work / "ours.onnx"
    seconds = tools.quantize_ours(det, calib, None, path, calib[0], recipe=recipe)
    t0 = time.perf_counter()
    layout = work / "ours_ov.onnx"
    qb.openvino_layout(path, layout)
    seconds["openvino_layout_s"] = time.perf_counter() - t0
    return path, layout, seconds


def _nncf(det: Path, batches: list, work: Path) -> Path:
    from bench.suite import peer_child, peers

    npz = work / "calib.npz"
    peer_child.save_batches(npz, batches)
    out = work / "nncf_ov.xml"
    spec = {"float_onnx": str(det), "calib": str(npz), "out": str(out)}
    proc = subprocess.run(
        [peers.peers_python("nncf"), "-c", NNCF_CHILD.format(root=str(ROOT)), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["no output"])[-1])
    print(f"nncf: {proc.stdout.strip().splitlines()[-1]}")
    return out


def _census(compiled) -> dict[str, int]:
    c: collections.Counter = collections.Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        if rt["layerType"].astype(str) in ("Const", "Input", "Output", "Reshape"):
            continue
        precision = rt["runtimePrecision"].astype(str) if "runtimePrecision" in rt else "?"
        c[f"{rt['layerType'].astype(str)}:{precision}"] += 1
    return dict(sorted(c.items()))


def _perf(compiled, feeds: dict, reps: int = 5) -> dict[str, float]:
    """ms per inference by executed layer type and kernel (OpenVINO PERF_COUNT)."""
    request = compiled.create_infer_request()
    for _ in range(2):
        request.infer(feeds)
    total: collections.Counter = collections.Counter()
    for _ in range(reps):
        request.infer(feeds)
        for p in request.profiling_info:
            if p.status == p.Status.EXECUTED:
                total[f"{p.node_type}:{p.exec_type}"] += p.real_time.total_seconds() * 1e3 / reps
    return dict(total.most_common())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=480)
    ap.add_argument("--calib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--recipe", default="native")
    ap.add_argument("--no-nncf", action="store_true")
    ap.add_argument("--perf", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import openvino as ov

    from bench.suite import engines, speed
    from bench.suite.timing import interleave, paired_ratio, summary
    from bench.suite.workloads import ocr_det_path

    det = ocr_det_path()
    batches, feeds = _feeds(det, args.size, args.calib)
    work = Path(tempfile.mkdtemp(prefix="qb-ov-layout-"))
    ours, ours_ov, seconds = _ours(det, batches, args.recipe, work)
    print(f"ours ({args.recipe}): {json.dumps({k: round(v, 1) for k, v in seconds.items()})}")
    files = {"float": det, "ours": ours, "ours_ov": ours_ov}
    if not args.no_nncf:
        try:
            files["nncf_ov"] = _nncf(det, batches, work)
        except Exception as e:  # a missing peer is a row, not a crash
            print(f"nncf_ov: failed: {e}")
    reference = {k: p for k, p in files.items() if p.suffix == ".onnx"}
    ref_out = {
        k: engines.ort_runner(engines.ort_session(p, optimize=False), feeds)()[0]
        for k, p in reference.items()
    }
    result: dict = {"size": args.size, "files": {k: str(v) for k, v in files.items()}, "forms": {}}
    runners = {}
    config = {"PERF_COUNT": True} if args.perf else {}
    for name, path in files.items():
        compiled = ov.Core().compile_model(
            str(path),
            "CPU",
            {"INFERENCE_NUM_THREADS": engines.THREADS, "NUM_STREAMS": 1,
             "PERFORMANCE_HINT": "LATENCY", **config},
        )  # fmt: skip
        runner = engines.ov_runner(compiled, feeds)
        out = np.asarray(next(iter(runner().values())))
        check = speed.check_output(ref_out.get(name, ref_out["float"]), out)
        form = {"check": check, "sqnr_vs_float_db": sqnr_db(ref_out["float"], out)}
        form["census"] = _census(compiled)
        if args.perf:
            form["perf_ms"] = _perf(compiled, feeds)
        result["forms"][name] = form
        against = "node by node" if name in ref_out else "float"
        print(f"{name}: vs ORT {against} {check['sqnr_db']:.1f} dB, vs float "
              f"{form['sqnr_vs_float_db']:.1f} dB{'' if check['ok'] else ' WRONG: ' + check['why']}")  # fmt: skip
        print(f"  layers: {form['census']}")
        if args.perf:
            top = list(form["perf_ms"].items())[:8]
            print("  perf ms: " + ", ".join(f"{k} {v:.1f}" for k, v in top))
        if check["ok"]:
            runners[name] = runner
    samples = interleave(runners, args.rounds, warmup=2, same_calls=True)
    for name, s in samples.items():
        ms = summary(s["wall_ms"])
        result["forms"][name]["ms"] = ms
        print(f"{name}: {ms['median']:.1f} ms [{ms['min']:.1f}-{ms['max']:.1f}] "
              f"({ms['n']} rounds, {s['calls']} calls per sample)")  # fmt: skip
    result["ratios"] = {}
    for name in samples:
        if name != "float" and "float" in samples:
            r = paired_ratio(samples["float"]["wall_ms"], samples[name]["wall_ms"])
            result["ratios"][f"float / {name}"] = r
            print(f"float / {name}: {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
