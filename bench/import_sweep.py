"""Import sweep: INT8 ONNX files written by other tools, each through every step of quantbridge.

    python -m bench.import_sweep                        # every file; table on stdout
    python -m bench.import_sweep --only ort_ --models resnet18 --json sweep.json

Per file (``bench.import_producers`` writes them; settings in the file name): ``qb.import_onnx``;
the imported module against ONNX Runtime on the file (graph optimisations off: the node-by-node
float simulation the import reproduces) in steps of the output's quantizer (``LSB``: the scale
of the DequantizeLinear writing the output, or of the imported output quantizer); five Adam
steps of a training loop (weights must change, the loss must fall); ``qb.export`` of the import
and ONNX Runtime on it against ONNX Runtime on the file; ``qb.fold`` and ``qb.lower`` of the
file and of the re-export; ``qb.compare`` of the file with the import. A step that raises shows
the start of its message. Never run by CI (minutes; needs NNCF and ModelOpt environments).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

import quantbridge as qb

from . import import_producers as P


def _ort(model, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = model if isinstance(model, str) else model.SerializeToString()
    sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


_PASS_THROUGH = {"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Gather"}


def output_lsb(path: str, qmodel) -> float | None:
    """The step of the file's output: the DequantizeLinear writing it (through shape ops)."""
    model = onnx.load(path, load_external_data=False)
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    consts = {i.name: i for i in g.initializer}
    consts.update({n.output[0]: n.attribute[0].t for n in g.node if n.op_type == "Constant"})
    name = g.output[0].name
    while name in producer and producer[name].op_type in _PASS_THROUGH:
        name = producer[name].input[0]
    node = producer.get(name)
    if node is not None and node.op_type == "DequantizeLinear" and node.input[1] in consts:
        scale = onnx.numpy_helper.to_array(consts[node.input[1]])
        if scale.size == 1:
            return float(scale.reshape(()))
    try:
        return float(qmodel.output_quantizer(0).scale.reshape(()))
    except Exception:
        return None


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:110]}" if str(e) else type(e).__name__


def _lsb(a, b, lsb) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / lsb)


def check(path: Path, model: str, work: Path) -> dict:
    """Every step on one file; each cell a number or the error that stopped it."""
    row: dict = {"file": path.name}
    x = P.inputs(model, 4, 7)
    xt = torch.from_numpy(x)
    ref = _ort(str(path), x)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qm = qb.import_onnx(str(path), example_inputs=xt[:2])
    except Exception as e:
        row["import"] = _err(e)
        return row
    row["import"] = type(qm).__name__
    lsb = output_lsb(str(path), qm) or float(np.abs(ref).max() / 127)
    row["lsb"] = lsb
    with torch.no_grad():
        ours = qm(xt)
    ours = ours[0] if isinstance(ours, tuple) else ours
    row["torch_vs_ort"] = _lsb(ours.numpy(), ref, lsb)
    row["train"] = _train(qm, xt)
    out = work / (path.stem + "_reexport.onnx")
    try:
        qb.export(qm, out, example_inputs=xt[:2])
        row["reexport_vs_file"] = _lsb(_ort(str(out), x), ref, lsb)
    except Exception as e:
        row["reexport_vs_file"] = _err(e)
        out = None
    for label, src in (("file", path), ("reexport", out)):
        if src is None:
            continue
        try:
            folded = qb.fold(str(src))
            row[f"fold_{label}"] = _lsb(_ort(folded, x), ref, lsb)
        except Exception as e:
            row[f"fold_{label}"] = _err(e)
        try:
            program = qb.lower(str(src), input_shapes={"x": tuple(x.shape)})
            (low, *_) = program.run({"x": x}).values()
            row[f"lower_{label}"] = _lsb(low, ref, lsb)
        except Exception as e:
            row[f"lower_{label}"] = _err(e)
    row["compare"] = _compare(path, qm, x)
    return row


def _train(qm, xt: torch.Tensor) -> str:
    """Five Adam steps towards a fixed random target: loss first -> last, weights changed?"""
    try:
        m = copy.deepcopy(qm).train()
        params = [p for p in m.parameters() if p.requires_grad and p.is_floating_point()]
        before = [p.detach().clone() for p in params]
        with torch.no_grad():
            y0 = m(xt)
        y0 = y0[0] if isinstance(y0, tuple) else y0
        target = torch.randn_like(y0)
        opt = torch.optim.Adam(params, lr=1e-3)
        losses = []
        for _ in range(5):
            opt.zero_grad()
            y = m(xt)
            loss = torch.nn.functional.mse_loss(y[0] if isinstance(y, tuple) else y, target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        changed = sum(not torch.equal(a, p.detach()) for a, p in zip(before, params, strict=True))
        ok = changed > 0 and losses[-1] < losses[0]
        return f"{'ok' if ok else 'FAIL'} {losses[0]:.3g}->{losses[-1]:.3g} ({changed}/{len(params)} changed)"
    except Exception as e:
        return _err(e)


def _compare(path: Path, other, x: np.ndarray) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = qb.compare(str(path), other, inputs={"x": x})
        first = res.first_divergence
        errs = res.errors
        unmatched = sum(len(v) for v in res.unmatched.values())
        where = first.get("tensor", first) if isinstance(first, dict) else first
        return (
            f"{len(res.tensors)} tensors, first divergence {where}, {len(errs)} errors, {unmatched} unmatched"
            + (f" [{next(iter(errs.values()))[:80]}]" if errs else "")
        )
    except Exception as e:
        return _err(e)


# -- the files ----------------------------------------------------------------------------------
_TYPES = {"u8s8": ("QUInt8", "QInt8"), "s8s8": ("QInt8", "QInt8"), "u8u8": ("QUInt8", "QUInt8"),
          "u16s8": ("QUInt16", "QInt8"), "s16s16": ("QInt16", "QInt16"),
          "u16u16": ("QUInt16", "QUInt16"), "u8s4": ("QUInt8", "QInt4"),
          "u8u4": ("QUInt8", "QUInt4")}  # fmt: skip


def ort_cases() -> list[tuple[str, dict]]:
    """(name, quantize_static settings): formats x per-channel x types, then one option each."""
    cases = []
    for fmt in ("QDQ", "QOperator"):
        for pc in (False, True):
            for t in ("u8s8", "s8s8", "u8u8") if fmt == "QOperator" else _TYPES:
                act, w = _TYPES[t]
                cases.append((f"ort_{fmt}_pc{int(pc)}_{t}", dict(fmt=fmt, per_channel=pc,
                              activation_type=act, weight_type=w)))  # fmt: skip
    base = dict(fmt="QDQ", per_channel=True, activation_type="QUInt8", weight_type="QInt8")
    cases.append(("ort_QDQ_reduce_range", dict(base, reduce_range=True)))
    cases.append(("ort_QOperator_reduce_range", dict(base, fmt="QOperator", reduce_range=True)))
    cases.append(("ort_QDQ_entropy", dict(base, calibrate_method="Entropy")))
    cases.append(("ort_QDQ_percentile", dict(base, calibrate_method="Percentile")))
    for opt, value in [("ActivationSymmetric", True), ("WeightSymmetric", False),
                       ("QDQKeepRemovableActivations", True), ("DedicatedQDQPair", True),
                       ("ForceQuantizeNoInputCheck", True), ("MatMulConstBOnly", False),
                       ("CalibMovingAverage", True), ("AddQDQPairToWeight", True),
                       ("QDQOpTypePerChannelSupportToAxis", {"MatMul": 1, "Gemm": 0})]:  # fmt: skip
        cases.append((f"ort_QDQ_{opt}", dict(base, extra_options={opt: value})))
    return cases


def producers(folder: Path, model: str):
    """(case, function writing the file to a path) for every producer setting."""
    src = P.float_file(model, folder)
    for case, settings in ort_cases():
        yield case, lambda d, s=settings: P.ort_static(src, d, model, **s)
    yield "ort_pre_QDQ", lambda d: P.ort_static(P.pre_processed(src, folder), d, model)
    for case, kw in [("ortdyn_s8", dict(weight_type="QInt8")),
                     ("ortdyn_u8_pc", dict(weight_type="QUInt8", per_channel=True)),
                     ("ortdyn_s8_rr", dict(weight_type="QInt8", reduce_range=True))]:  # fmt: skip
        yield case, lambda d, k=kw: P.ort_dynamic(src, d, **k)
    for config in ("default", "mixed", "transformer"):
        yield f"nncf_{config}", lambda d, c=config: P.peer("nncf", c, src, d, model)
    for config in ("default", "max fp32", "entropy fp32"):
        yield (f"modelopt_{config.replace(' ', '_')}",
               lambda d, c=config: P.peer("modelopt", c, src, d, model))  # fmt: skip
    yield from _hand_edits(folder, model, src)


def make_files(folder: Path, models: list[str], only: str):
    """(model, case, path) for every file, made as asked for; a producer that fails gives its
    error instead of the path."""
    for model in models:
        for case, fn in producers(folder, model):
            if only and not any(o in case for o in only.split(",")):
                continue
            dst = folder / f"{model}__{case}.onnx"
            try:
                yield model, case, dst if dst.exists() else fn(dst)
            except Exception as e:
                yield model, case, _err(e)


def _hand_edits(folder, model, src):
    base = folder / f"{model}__ort_QDQ_pc1_u8s8.onnx"

    def edited(fn, *args, external=False):
        def make(dst):
            if not base.exists():
                P.ort_static(src, base, model, fmt="QDQ", per_channel=True,
                             activation_type="QUInt8", weight_type="QInt8")  # fmt: skip
            return P.save(fn(onnx.load(str(base)), *args), dst, external)

        return make

    for v in (13, 19, 21):
        yield f"edit_opset{v}", edited(P.set_opset, v)
    yield (
        "edit_opset10_pt",
        lambda d: P.ort_static(P.float_file(model, folder, 10), d, model, per_channel=False),
    )
    yield "edit_1elem_qparams", edited(P.one_element_qparams)
    yield "edit_no_zero_point", edited(P.drop_zero_points)
    yield "edit_const_qparams", edited(P.params_as_constant_nodes, False)
    yield "edit_const_weights", edited(P.params_as_constant_nodes, True)
    yield "edit_dq_transpose_mm", edited(P.transposed_weights, "Transpose")
    yield "edit_dq_reshape_mm", edited(P.transposed_weights, "Reshape")
    yield "edit_blocked_int8", edited(P.blocked_weights, 16, onnx.TensorProto.INT8)
    yield "edit_blocked_int4", edited(P.blocked_weights, 16, onnx.TensorProto.INT4)
    yield "edit_external_data", edited(lambda m: m, external=True)


_COLUMNS = ["torch_vs_ort", "train", "reexport_vs_file", "fold_file", "lower_file", "compare"]


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)[:48] if value is not None else "-"


def render(rows: list[dict]) -> str:
    """A markdown table of the rows (LSB numbers to 2 decimals, errors cut to 48 characters)."""
    lines = ["| file | import | " + " | ".join(_COLUMNS) + " |", "|---" * (len(_COLUMNS) + 2) + "|"]
    for r in rows:
        first = r.get("import", r.get("producer", r.get("sweep")))
        cells = [r["file"].removesuffix(".onnx"), _cell(first)]
        lines.append("| " + " | ".join(cells + [_cell(r.get(c)) for c in _COLUMNS]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(P.MODELS), default=sorted(P.MODELS))
    parser.add_argument(
        "--only", default="", help="cases whose name contains one of these (comma-separated)"
    )
    parser.add_argument("--folder", default=None, help="keep the files here (default: temp)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--render", nargs="+", default=None, help="JSON-lines files: table only")
    args = parser.parse_args(argv)
    if args.render:
        print(
            render(
                [json.loads(line) for f in args.render for line in open(f) if line.startswith("{")]
            )
        )
        return
    torch.set_num_threads(1)
    folder = Path(args.folder or tempfile.mkdtemp(prefix="qb_sweep_"))
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for model, case, path in make_files(folder, args.models, args.only):
        t0 = time.perf_counter()
        if isinstance(path, str):
            row = {"file": f"{model}__{case}", "producer": path}
        else:
            try:
                row = check(path, model, folder)
            except Exception as e:
                row = {"file": path.name, "sweep": _err(e), "trace": traceback.format_exc()[-300:]}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(render(rows))


if __name__ == "__main__":
    main()
