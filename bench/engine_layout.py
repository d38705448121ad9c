"""``qb.to_engine(q, "openvino")`` on the PP-OCRv4 detector: the OpenVINO layout (the default) and
ONNX Runtime's (``layout="onnxruntime"``) against OpenVINO's own float, through the engine model.

    python -m bench.engine_layout                    # 1x3x480x480, default recipe, 2 threads
    python -m bench.engine_layout --rounds 15 --threads 1

The detector (``../shared/models/ppocr``, found by ``tests/ppocr_models.py``) is imported
(``qb.import_onnx``) and quantized with the default recipe on ``--calib`` rendered text images
(``bench.suite.ocr_data``); a held-out image is the timed input. Rows, timed in one interleaved
loop (``bench.suite.timing``), each called as the user calls it (torch tensor in, torch out):

* ``float``: ``qb.to_engine(<float .onnx file>, "openvino")``: OpenVINO's float (f32, as the
  engine model asks);
* ``ov``: ``qb.to_engine(qmodel, "openvino")``: the default, the OpenVINO layout;
* ``ort``: ``qb.to_engine(qmodel, "openvino", layout="onnxruntime")``: the canonical QDQ file.

Reported: ``float / form`` per round (above 1: INT8 faster), median [min-max]; SQNR of each
form's output against the torch QuantModel's (``qmodel(x)``) and against OpenVINO's float; as
references, OpenVINO's float and ``qb.to_engine(qmodel, "onnxruntime")`` against the QuantModel.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

from bench.suite.accuracy import sqnr_db

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=480)
    ap.add_argument("--calib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import quantbridge as qb
    from bench.suite import ocr_data, timing
    from tests.ppocr_models import ppocr_dir, skip_reason

    folder = ppocr_dir()
    if folder is None:
        print(skip_reason())
        return 1
    det = str(folder / "ch_PP-OCRv4_det_infer.onnx")
    calib = [torch.from_numpy(ocr_data.batch([i], args.size)) for i in range(args.calib)]
    x = torch.from_numpy(ocr_data.batch([10_000], args.size))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = qb.quantize(qb.import_onnx(det), calib, progress=False)
        ref = qmodel(x).detach().numpy()
        engines = {
            "float": qb.to_engine(det, "openvino", threads=args.threads),
            "ov": qb.to_engine(qmodel, "openvino", example_inputs=x, threads=args.threads),
            "ort": qb.to_engine(
                qmodel, "openvino", example_inputs=x, threads=args.threads, layout="onnxruntime"
            ),
        }
    outs = {name: e(x).numpy() for name, e in engines.items()}
    runs = timing.interleave({n: (lambda e=e: e(x)) for n, e in engines.items()}, args.rounds)
    result = {"size": args.size, "threads": args.threads, "rounds": args.rounds, "forms": {}}
    for name in ("ov", "ort"):
        ratio = timing.paired_ratio(runs["float"]["wall_ms"], runs[name]["wall_ms"])
        cpu = timing.paired_ratio(runs["float"]["cpu_ms"], runs[name]["cpu_ms"])
        row = {
            "layout": engines[name].layout,
            "float_over_form": ratio,
            "float_over_form_cpu": cpu,
            "sqnr_vs_qmodel_db": sqnr_db(ref, outs[name]),
            "sqnr_vs_float_db": sqnr_db(outs["float"], outs[name]),
        }
        result["forms"][name] = row
        print(
            f"{name:5s} layout={row['layout']:11s} float/form {ratio['median']:.2f} "
            f"[{ratio['min']:.2f}-{ratio['max']:.2f}] (cpu {cpu['median']:.2f}); SQNR vs "
            f"QuantModel {row['sqnr_vs_qmodel_db']:.1f} dB, vs OV float "
            f"{row['sqnr_vs_float_db']:.1f} dB"
        )
    for name, run in runs.items():
        s = timing.summary(run["wall_ms"])
        print(f"{name:5s} {s['median']:.1f} ms [{s['min']:.1f}-{s['max']:.1f}]")
    result["float_sqnr_vs_qmodel_db"] = sqnr_db(ref, outs["float"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ort = qb.to_engine(qmodel, "onnxruntime", example_inputs=x, threads=args.threads)(x)
    result["onnxruntime_sqnr_vs_qmodel_db"] = sqnr_db(ref, ort.numpy())
    print(
        f"references: OpenVINO float vs QuantModel {result['float_sqnr_vs_qmodel_db']:.1f} dB; "
        f"qb.to_engine(qmodel, 'onnxruntime') vs QuantModel "
        f"{result['onnxruntime_sqnr_vs_qmodel_db']:.1f} dB"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
