"""Figure 1: accuracy of the INT8 result, ours vs every peer's default and best settings (``peers``).

Every INT8 model is judged against the float model on the same held-out inputs: top-1 on digits
(against labels, float shown beside), mean cosine of sentence embeddings for MiniLM, output SQNR
in dB for the CNNs and the OCR detector (plus its text-mask IoU), lines read exactly for the OCR
recognizer and same class as float for the direction classifier (``ocr_lines``). Ours and ONNX Runtime's models
run in ONNX Runtime; PyTorch's run in torch (its quantized x86 kernels).
"""

from __future__ import annotations

import re
import statistics
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

from quantbridge.optables import DATA_MOVEMENT_OPS, WEIGHTED_OPS

from . import engines, ocr_lines, peers, tools
from .workloads import Workload

NOT_BUILT = "n/a (ONNX import not built yet)"


def sqnr_db(ref: np.ndarray, out: np.ndarray) -> float:
    ref, out = ref.astype(np.float64), out.astype(np.float64)
    noise = np.sum((ref - out) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(ref**2) / noise))


def mean_cosine(ref: np.ndarray, out: np.ndarray) -> float:
    ref, out = ref.reshape(len(ref), -1).astype(np.float64), out.reshape(len(out), -1)
    out = out.astype(np.float64)
    cos = (ref * out).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(out, axis=1) + 1e-30)
    return float(cos.mean())


def mask_iou(ref: np.ndarray, out: np.ndarray, threshold: float = 0.3) -> float:
    a, b = ref > threshold, out > threshold
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


def score(w: Workload, ref: np.ndarray, out: np.ndarray) -> dict[str, float]:
    if w.metric == "top1":
        return {"top1": float((out.argmax(1) == w.labels).mean())}
    if w.metric == "lines":  # against the rendered texts, not against float
        return {"lines": ocr_lines.lines_read(out, w.labels, w.characters)}
    if w.metric == "agreement":
        return {"agreement": ocr_lines.same_label(ref, out),
                "logit_sqnr_db": ocr_lines.logit_sqnr_db(ref, out)}  # fmt: skip
    if w.metric == "cosine":
        return {"cosine": mean_cosine(ref, out)}
    result = {"sqnr_db": sqnr_db(ref, out)}
    if w.name == "ocr_det":
        result["mask_iou"] = mask_iou(ref, out)
    return result


def _ort_eval(w: Workload, path: Path, ref: np.ndarray) -> dict[str, float]:
    out = engines.ort_outputs(engines.ort_session(path), w.eval_feeds)
    return score(w, ref, out)


def _row(tool: str, method: str, fn: Callable[[], dict]) -> dict:
    try:
        return {"tool": tool, "method": method, **fn()}
    except Exception as e:  # one failing peer is a result, not a crashed suite
        return {
            "tool": tool,
            "method": method,
            "error": tools.short_error(e),
            "trace": traceback.format_exc(limit=3)[-800:],
        }


def calibration_subsets(n_batches: int, repeats: int) -> list[list[int]]:
    """Batch indices per repeat: all batches first, then each repeat leaves one batch out (the
    run-to-run spread of a deterministic quantizer comes from its calibration data)."""
    subsets = [list(range(n_batches))]
    for r in range(1, repeats):
        drop = (r - 1) % n_batches
        subsets.append([i for i in range(n_batches) if i != drop] or [0])
    return subsets


def file_slug(name: str) -> str:
    """A configuration's name as a file name part ('MatMul/Gemm only' holds a slash)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def _constants(model) -> set[str]:
    """The names of a model's initializers and Constant nodes' outputs."""
    names = {i.name for i in model.graph.initializer}
    return names | {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}


def _dequantized(model) -> Callable[[str], bool]:
    """``dequantized(name)``: the value holds int8 values, i.e. comes from a DequantizeLinear
    through data movement (a Transpose of a dequantized tensor is still int8 values; a Concat
    when every part does)."""
    producer = {o: n for n in model.graph.node for o in n.output}

    def dequantized(name: str) -> bool:
        node = producer.get(name)
        if node is not None and node.op_type == "Concat":  # every part, not the first alone
            return all(dequantized(i) for i in node.input)
        if node is not None and node.op_type in DATA_MOVEMENT_OPS and node.input:
            return dequantized(node.input[0])
        return node is not None and node.op_type == "DequantizeLinear"

    return dequantized


def quantized_coverage(path: Path) -> dict[str, int]:
    """What an INT8 file quantizes (rows differ: ModelOpt and NNCF leave residual Adds float):
    QuantizeLinear nodes on activations, and weights stored in float and quantized at run time
    (a QuantizeLinear on an initializer) rather than stored as integers."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    constants = _constants(model)
    qs = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    on_constants = sum(1 for n in qs if n.input[0] in constants)
    return {"activation_q": len(qs) - on_constants, "float_weights_q": on_constants}


def weighted_inputs(path: Path) -> dict[str, int]:
    """The file's own arithmetic: weighted ops (Conv, Gemm, MatMul ...) whose first two inputs
    both come from a DequantizeLinear (through data movement: a Transpose of a dequantized tensor
    is still int8 values), i.e. that an int8 engine runs as integer products whatever follows
    (``file_int8_weighted``), and the others (``file_float_weighted``). NNCF's and ModelOpt's
    layouts quantize conv inputs only: ONNX Runtime runs such a conv in float for want of an
    output Q (``ort_compute``), on exactly the int8 values OpenVINO / TensorRT multiply."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    dequantized = _dequantized(model)
    weighted = [n for n in model.graph.node if n.op_type in WEIGHTED_OPS and len(n.input) >= 2]
    int8 = sum(1 for n in weighted if dequantized(n.input[0]) and dequantized(n.input[1]))
    return {"file_int8_weighted": int8, "file_float_weighted": len(weighted) - int8}


def residual_adds(path: Path) -> dict[str, int]:
    """The file's adds of two activations (residual adds; an add of a constant, a bias, is not
    one): on int8 values (both operands come from a DequantizeLinear, through data movement) or
    not. Tells the layouts apart (``verdicts.layout``): ours' default and NNCF's files quantize
    both operands; ModelOpt's quantizes the shortcut only and ``activation_scope=
    "weighted_inputs"`` neither, so their residual sums (what a ResNet's output carries) stay
    float."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    constants, dequantized = _constants(model), _dequantized(model)
    adds = [n for n in model.graph.node if n.op_type == "Add" and len(n.input) == 2]
    adds = [n for n in adds if not any(i in constants for i in n.input)]
    int8 = sum(1 for n in adds if all(dequantized(i) for i in n.input))
    return {"file_int8_adds": int8, "file_float_adds": len(adds) - int8}


def constant_output_sqnr_db(ref: np.ndarray) -> float:
    """The SQNR a model scores that ignores its input and outputs the float model's mean output
    over the evaluation samples: ``10 log10(sum ref^2 / sum (ref - mean)^2)``, how far the
    input-dependent part of the float output lies below its constant part. Random-weight CNNs
    whose BN statistics do not match their activations lose the input layer after layer
    (ResNet-18-style, bench quick: 45.8 dB; MobileNetV2-style: 142 dB, its logits do not depend
    on the input at float32 precision): a row's SQNR there mostly measures how well it keeps
    the constant part (the biases' accumulated mean error), and a row below this value tracks
    the input less than a constant does."""
    ref = ref.astype(np.float64)
    return sqnr_db(ref, np.broadcast_to(ref.mean(0, keepdims=True), ref.shape))


def ort_compute(path: Path) -> dict[str, int]:
    """What ONNX Runtime's optimized graph runs (``engines.compute_ops``): integer operators
    (QLinearConv, QGemm, QLinearAdd, ...) and weighted ops left in float. A QDQ file whose convs
    have no output Q (ModelOpt's ResNet-18 at its best: 20 convs in float) scores as a float
    model with rounded inputs, not as an INT8 one."""
    optimized = path.with_suffix(".ort-optimized.onnx")
    engines.ort_session(path, optimized_path=optimized)
    ops = engines.compute_ops(optimized)
    optimized.unlink(missing_ok=True)
    int8 = sum(v for k, v in ops.items() if k in engines.INT8_ORT_OPS)
    floats = sum(v for k, v in ops.items() if k in engines.FLOAT_COMPUTE_OPS)
    return {"ort_int8_ops": int8, "ort_float_weighted_ops": floats}


def _config_row(c: peers.Config, w: Workload, work: Path, ref, repeats: int, files: dict) -> dict:
    subsets = calibration_subsets(len(w.calib_feeds), repeats)
    values, seconds, extra = [], [], {}
    key = None
    for r, idx in enumerate(subsets):
        calib = [w.calib[i] for i in idx]
        feeds = [w.calib_feeds[i] for i in idx]
        if c.runner == "torch":
            if w.model is None:
                return {"not_applicable": NOT_BUILT}
            converted, secs = tools.quantize_fx(w.model, calib, c.name)
            scores = score(w, ref, tools.torch_outputs(converted, w.eval_torch))
            secs = {"total_s": secs}
        else:
            path = work / f"{w.name}.{file_slug(f'{c.tool}.{c.name}')}.r{r}.onnx"
            secs = peers.quantize_onnx(c, w, calib, feeds, path)
            scores = _ort_eval(w, path, ref)
            if r == 0:
                files[f"{c.tool}/{c.name}"] = str(path)
                extra["graph"] = quantized_coverage(path) | weighted_inputs(path)
                extra["graph"] |= residual_adds(path)
                extra["graph"] |= ort_compute(path)
        key = key or next(iter(scores))
        values.append(scores[key])
        for k, v in scores.items():  # mask IoU, logit SQNR: repeat 0's, and every repeat's
            if k != key:
                extra.setdefault(k, v)
                extra.setdefault(f"{k}_values", []).append(v)
        seconds.append(secs.pop("total_s", None))
        extra |= {k: v for k, v in secs.items() if k not in ("calibrate_s", "export_s")}
    return {key: statistics.median(values), "values": values, **extra,
            "seconds": {"total_s": statistics.median([x for x in seconds if x is not None] or [0])}}  # fmt: skip


def run(
    w: Workload,
    work: Path,
    configs: list[peers.Config],
    log: Callable[[str], None],
    repeats: int = 1,
) -> dict:
    """Rows for one workload, one per configuration (``peers.configs``), each with one metric
    value per calibration repeat; ``files["<tool>/<config>"]`` are the INT8 ONNX files of the
    first repeat (figure 2 times ``quantbridge/default`` and ORT's u8/s8 per-channel minmax)."""
    float_session = engines.ort_session(w.float_onnx)
    ref = engines.ort_outputs(float_session, w.eval_feeds)
    result: dict = {
        "metric": w.metric,
        "float": score(w, ref, ref) if w.metric in ("top1", "lines") else None,
        # the score of an output that ignores the input (``constant_output_sqnr_db``)
        "constant_sqnr_db": constant_output_sqnr_db(ref) if w.metric == "sqnr" else None,
        "repeats": repeats,
        "rows": [],
        "files": {},
    }
    rows, files = result["rows"], result["files"]
    for c in configs:
        if (c.workloads is not None and w.name not in c.workloads) or w.name in c.exclude:
            continue
        log(f"  {w.name}: {c.tool} {c.name}")
        row = _row(c.tool, c.name, lambda c=c: _config_row(c, w, work, ref, repeats, files))
        rows.append({**row, "config": c.name, "default": c.default})
    if "quantbridge/default" in files:
        files.setdefault("ours/minmax", files["quantbridge/default"])
    if "onnxruntime/u8s8 per-channel minmax" in files:
        files["ort/minmax"] = files["onnxruntime/u8s8 per-channel minmax"]

    for name, (rules, excluded) in w.variants.items():
        method = "minmax"
        path = work / f"{w.name}.ours.{method}.variant.onnx"

        def ours_variant(path=path, rules=rules, method=method, name=name) -> dict:
            from quantbridge import Rule

            skip = tuple(Rule(pattern=p, skip=True) for p in rules)
            seconds = tools.quantize_ours(w.model, w.calib, method, path, w.example, skip)
            files[f"ours/{method}/{name}"] = str(path)
            return {**_ort_eval(w, path, ref), "seconds": seconds, "variant": name}

        log(f"  {w.name}: quantbridge {method}, {name}")
        rows.append({**_row("quantbridge", method, ours_variant), "config": method})
        path_ort = work / f"{w.name}.ort.{method}.variant.onnx"

        def ort_variant(path=path_ort, excluded=excluded, method=method, name=name) -> dict:
            seconds = tools.quantize_ort(w.float_onnx, w.calib_feeds, method, path, excluded)
            files[f"ort/{method}/{name}"] = str(path)
            return {
                **_ort_eval(w, path, ref),
                "seconds": seconds,
                "variant": name,
                "excluded_nodes": len(excluded),
            }

        log(f"  {w.name}: onnxruntime {method}, {name}")
        rows.append({**_row("onnxruntime", method, ort_variant), "config": method})
    return result
