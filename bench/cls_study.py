"""The PP-OCR direction classifier (bench workload ``ocr_cls``): why ours' default reads one line
of 32 differently from float where NNCF's default does not, with measures finer than one image.

``python -m bench.cls_study files --size quick|full --rows default,mse,nncf --work /tmp/cls``
quantizes the float file once per calibration repeat (the bench's splits:
``accuracy.calibration_subsets``) per row and writes ``<work>/<size>.<row>.r<k>.onnx``;
``margins`` runs every file on the evaluation lines (ORT, fused, as the bench scores) and prints,
per row and repeat, the agreement, the SQNR of the logits and of the softmax against float, and
the lines whose class flips with their float margin; ``layers`` gives the SQNR against float of
every conv output and the logits of each file (ONNX Runtime node by node, the convs matched by
their order; written when ``qb.compare`` paired only 8 of the file's 151 tensors with the float
file, 142 since stop 15). The model ends ``MatMul -> Add -> Softmax`` with two classes: the logit margin is
``log p1 - log p0`` of the softmax output, exact up to float32 rounding of ``p``.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import numpy as np

from bench.suite import accuracy, engines, peers, workloads

ROWS = {
    "default": peers.Config("quantbridge", "default", True),
    "mse": peers.Config("quantbridge", peers.MSE_AVX2),
    "onepass": peers.Config("quantbridge", peers.ONE_PASS),
    "nncf": peers.Config("nncf", "default", True),
}


def workload(size: str, work: Path):
    sizes = workloads.QUICK if size == "quick" else workloads.FULL
    return workloads.ocr_cls(work, sizes, print)


def files(args) -> None:
    w = workload(args.size, args.work)
    subsets = accuracy.calibration_subsets(len(w.calib_feeds), args.repeats)
    for row in args.rows.split(","):
        c = ROWS.get(row) or peers.Config("quantbridge", row)
        for r, idx in enumerate(subsets):
            feeds = [w.calib_feeds[i] for i in idx]
            path = args.work / f"{args.size}.{row}.r{r}.onnx"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                secs = peers.quantize_onnx(c, w, feeds, feeds, path)
            print(f"{path.name}: {len(feeds)} batches, {secs['total_s']:.0f} s", flush=True)


def margin(p: np.ndarray) -> np.ndarray:
    """Logit of class 1 minus class 0 from the softmax output (float64 logs)."""
    p = p.astype(np.float64)
    return np.log(p[:, 1]) - np.log(p[:, 0])


def sqnr(ref: np.ndarray, out: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((out - ref) ** 2), 1e-300)))


def expected_flips(m_ref: np.ndarray, err: np.ndarray) -> float:
    """Lines expected to change class if each line's margin error were drawn from the errors
    this file makes on all lines (their empirical distribution, not one draw): the sum over
    lines of the share of errors that would cross that line's float margin. A file's flips are
    one draw of this; two files whose expected counts differ by less than ~1 line cannot be
    told apart by agreement on this many lines."""
    crosses = np.sign(m_ref[:, None] + err[None, :]) != np.sign(m_ref[:, None])
    return float(crosses.mean(1).sum())


def margins(args) -> None:
    w = workload(args.size, args.work)
    ref = engines.ort_outputs(engines.ort_session(w.float_onnx), w.eval_feeds)
    m_ref = margin(ref)
    order = np.argsort(np.abs(m_ref))
    print(f"{len(ref)} lines; float |margin| smallest: "
          + ", ".join(f"#{i} {m_ref[i]:+.2f}" for i in order[:6]))  # fmt: skip
    table = {"float_margin": m_ref.tolist(), "rows": {}}
    for path in sorted(args.work.glob(f"{args.size}.*.r*.onnx")):
        out = engines.ort_outputs(engines.ort_session(path), w.eval_feeds)
        m = margin(out)
        flips = np.flatnonzero(np.sign(m) != np.sign(m_ref))
        err = m - m_ref
        row = {
            "agreement": float((out.argmax(1) == ref.argmax(1)).mean()),
            "sqnr_margin_db": sqnr(m_ref, m),
            "sqnr_softmax_db": sqnr(ref.astype(np.float64), out.astype(np.float64)),
            "margin_err_rms": float(np.sqrt(np.mean(err**2))),
            "margin_err_mean": float(err.mean()),
            "flips": {int(i): [float(m_ref[i]), float(m[i])] for i in flips},
            "expected_flips": expected_flips(m_ref, err),
            "margin": m.tolist(),
        }
        table["rows"][path.stem] = row
        near = ", ".join(f"#{i} {m_ref[i]:+.2f}->{m[i]:+.2f}" for i in order[:4])
        print(f"{path.stem:24s} agree {row['agreement']:.4f} | SQNR margin "
              f"{row['sqnr_margin_db']:5.2f} dB softmax {row['sqnr_softmax_db']:5.2f} dB | "
              f"margin err rms {row['margin_err_rms']:.3f} mean {row['margin_err_mean']:+.3f} | "
              f"flips {list(row['flips'])} (expected {row['expected_flips']:.2f}) | nearest: {near}",
              flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


def _layer_outputs(model) -> list[str]:
    """Per Conv in graph order its output after the BatchNormalization or bias Add that reads it
    alone (the float file keeps BN and adds the SE convs' and the classifier's biases in an Add
    of a reshaped constant; ours folds both into the op), then the logits."""
    consumers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    producer = {o: n for n in model.graph.node for o in n.output}
    constants = {i.name for i in model.graph.initializer}

    def is_bias(name: str) -> bool:
        node = producer.get(name)
        return name in constants or (node is not None and node.op_type in ("Reshape", "Constant"))

    names = []
    for n in model.graph.node:
        if n.op_type not in ("Conv", "Gemm", "MatMul"):
            continue
        out = n.output[0]
        after = consumers.get(out, [])
        if len(after) == 1 and after[0].op_type == "BatchNormalization":
            out = after[0].output[0]
        elif len(after) == 1 and after[0].op_type == "Add":
            if all(is_bias(i) for i in after[0].input if i != out):
                out = after[0].output[0]
        names.append(out)
    return names


def layer_values(path: Path, feeds: dict) -> list[np.ndarray]:
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(path))
    names = _layer_outputs(model)
    known = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in known)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts)
    return [v.astype(np.float64) for v in sess.run(names, feeds)]


def layers(args) -> None:
    """SQNR (dB) against float of every conv output and the logits, node by node (ORT, no
    fusion: the file's own QDQ arithmetic), for each file of ``--files``."""
    w = workload(args.size, args.work)
    feeds = w.eval_feeds[0]
    ref = layer_values(w.float_onnx, feeds)
    table = {}
    for name in args.files.split(","):
        vals = layer_values(args.work / f"{args.size}.{name}.onnx", feeds)
        if len(vals) != len(ref) or any(
            a.shape != b.shape for a, b in zip(ref, vals, strict=False)
        ):
            raise RuntimeError(f"{name}: {len(vals)} layer outputs against float's {len(ref)}")
        table[name] = [sqnr(a, b) for a, b in zip(ref, vals, strict=True)]
    names = list(table)
    print("layer  " + "  ".join(f"{n:>12s}" for n in names) + "   shape")
    for i, a in enumerate(ref):
        print(f"{i:5d}  " + "  ".join(f"{table[n][i]:12.2f}" for n in names) + f"   {a.shape[1:]}")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cls_study", description=__doc__)
    p.add_argument("stage", choices=["files", "margins", "layers"])
    p.add_argument("--size", choices=["quick", "full"], default="quick")
    p.add_argument("--rows", default="default,mse,nncf")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path("/tmp/cls"))
    p.add_argument("--json", type=Path)
    p.add_argument("--files", default="default.r0,nncf.r0,mse.r0", help="layers: files compared")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    {"files": files, "margins": margins, "layers": layers}[args.stage](args)


if __name__ == "__main__":
    main()
