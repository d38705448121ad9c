"""Which ONNX QDQ graph forms get the fast INT8 kernels on x86 CPUs?

ResNet-18-style CNN (random weights, BN folded), batch 8 x 3x224x224.
Runtimes: ONNX Runtime CPU EP (2 intra-op threads, ORT_ENABLE_ALL) and OpenVINO CPU
(2 threads, latency hint, 1 stream).

Every variant is emitted by a small QDQ writer (``build_qdq``) from one float ONNX graph, so a
row differs from the baseline row in exactly one aspect of the graph form. A few rows come from
``onnxruntime.quantization.quantize_static`` as references.

For each variant the script records: the op types ORT ends with after optimization (from
``SessionOptions.optimized_model_filepath``), the OpenVINO runtime-graph layer precisions,
latency (warm-up, then interleaved rounds; median/min/max) and the output cosine similarity to
the float model (a sanity check that the variant is a faithful quantization, not an accuracy
study: calibration and test inputs are random).

Usage:  python bench/forms_study/study.py [--rounds 15] [--no-ov] [--only REGEX]
Writes results.json and results.md into --out (default: bench/forms_study/results).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root
from bench.suite.machine import boost_priority  # noqa: E402

BATCH = 8
SEED = 0
THREADS = 2
HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.down is None else self.down(x)
        return self.relu(out + identity)


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layers(x)
        return self.fc(self.flatten(self.avgpool(x)))


def fold_bn(model: nn.Module) -> nn.Module:
    """Fold every Conv->BN pair into the conv (the conv gains a bias, the BN becomes Identity)."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    def visit(mod: nn.Module):
        names = list(mod._modules)
        for a, b in zip(names, names[1:], strict=False):
            ca, cb = mod._modules[a], mod._modules[b]
            if isinstance(ca, nn.Conv2d) and isinstance(cb, nn.BatchNorm2d):
                mod._modules[a] = fuse_conv_bn_eval(ca, cb)
                mod._modules[b] = nn.Identity()
        for child in mod.children():
            visit(child)

    visit(model)
    return model


def make_model() -> nn.Module:
    """Random weights; BN statistics from a few random batches so activations stay O(1)."""
    torch.manual_seed(SEED)
    model = ResNet18()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None  # cumulative average
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(BATCH, 3, 224, 224))
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return fold_bn(model.eval())


def export(model: nn.Module, path: Path, opset: int, dynamo: bool = False) -> Path:
    x = torch.randn(BATCH, 3, 224, 224)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = {
            "dynamo": dynamo,
            "opset_version": opset,
            "input_names": ["input"],
            "output_names": ["logits"],
        }
        if dynamo:
            kw["verbose"] = False
        torch.onnx.export(model, (x,), str(path), **kw)
    m = onnx.load(str(path))
    onnx.save(m, str(path))  # inline any external data the dynamo exporter wrote
    return path


# --------------------------------------------------------------------------------------------
# Calibration: min/max of every float tensor of the float graph
# --------------------------------------------------------------------------------------------


def tensor_ranges(path: Path, batches: list[np.ndarray]) -> dict[str, tuple[float, float]]:
    m = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    types = {vi.name: vi.type.tensor_type.elem_type for vi in m.graph.value_info}
    existing = {o.name for o in m.graph.output}
    for n in m.graph.node:
        for o in n.output:
            if o not in existing and types.get(o) == TensorProto.FLOAT:
                m.graph.output.append(helper.make_tensor_value_info(o, TensorProto.FLOAT, None))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    lo: dict[str, float] = {}
    hi: dict[str, float] = {}
    for x in batches:
        for name, v in zip(names, sess.run(None, {"input": x}), strict=True):
            lo[name] = min(lo.get(name, np.inf), float(v.min()))
            hi[name] = max(hi.get(name, -np.inf), float(v.max()))
    lo["input"] = min(float(b.min()) for b in batches)
    hi["input"] = max(float(b.max()) for b in batches)
    return {k: (lo[k], hi[k]) for k in lo}


# --------------------------------------------------------------------------------------------
# QDQ writer
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Form:
    """One QDQ graph form. Defaults are the recommended x86 form."""

    act: str = "u8"  # activations: u8 | s8 | u4 (u4 needs opset 21)
    act_sym: bool = False  # s8 activations with zero point 0
    w: str = "s8"  # weights: s8 | u8 (u8: zero point 128)
    w_per_channel: bool = True
    w_range: str = (
        "narrow"  # s8 weights: narrow [-127,127] (s=amax/127) | full [-128,127] (s=amax/127.5)
    )
    w_form: str = "int"  # int: int8 initializer -> DQ | fq: float initializer -> Q -> DQ
    bias: str = "int32"  # int32: int32 initializer -> DQ(scale=s_in*s_w) | float: float initializer
    relu: str = "fused"  # fused: Conv->Relu->Q | split: Conv->Q->DQ->Relu->Q | drop: no Relu, Q range [0,max]
    add: str = "qdq"  # qdq: DQ,DQ->Add | float_in: conv branch enters Add in float | float: both inputs float
    maxpool: str = "qdq"  # qdq: DQ->MaxPool->Q (same scale) | float: stem Conv->Relu->MaxPool->Q
    head: str = "qdq"  # qdq: DQ->GAP->Q, DQ->Flatten->Q | gap_float: GAP/Flatten in float, Q before fc | float
    fc: str = (
        "gemm"  # gemm: DQ->Gemm (float out) | gemm_q: Gemm->Q->DQ | matmul: MatMul+Add | float
    )
    clip4: str = "none"  # none | int: Q->Clip(0..15 on uint8)->DQ | float: Clip(0,15*s)->Q (post-ReLU tensors)
    dedicated_q: bool = False  # one Q->DQ pair per consumer instead of one shared Q->DQ


QTYPE = {"u8": TensorProto.UINT8, "s8": TensorProto.INT8, "u4": TensorProto.UINT4}
QRANGE = {"u8": (0, 255), "s8": (-128, 127), "u4": (0, 15)}
NPTYPE = {"u8": np.uint8, "s8": np.int8}


def act_qparams(lo: float, hi: float, act: str, sym: bool) -> tuple[float, int]:
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    qmin, qmax = QRANGE[act]
    if sym:
        scale = max(-lo, hi) / (qmax if act == "s8" else qmax - qmin)
        zp = 0 if act == "s8" else (qmin + qmax + 1) // 2
    else:
        scale = (hi - lo) / (qmax - qmin)
        zp = int(np.clip(round(qmin - lo / scale), qmin, qmax))
    return max(scale, 1e-8), zp


def quant_weight(w: np.ndarray, form: Form, axis: int):
    red = tuple(i for i in range(w.ndim) if i != axis)
    amax = np.abs(w).max(axis=red) if form.w_per_channel else np.abs(w).max()
    amax = np.maximum(amax, 1e-8).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    bcast = (lambda a: a.reshape(shape)) if form.w_per_channel else (lambda a: a)
    if form.w == "s8":
        if form.w_range == "narrow":
            scale, lo = amax / 127.0, -127
        else:
            scale, lo = amax / 127.5, -128
        q = np.clip(np.round(w / bcast(scale)), lo, 127).astype(np.int8)
        zp = np.zeros_like(scale, dtype=np.int8)
    else:
        scale = amax / 127.0
        q = np.clip(np.round(w / bcast(scale)) + 128, 0, 255).astype(np.uint8)
        zp = np.full_like(scale, 128, dtype=np.uint8)
    return q, scale.astype(np.float32), zp


class _Writer:
    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def init(self, name: str, value) -> str:
        if isinstance(value, onnx.TensorProto):
            value.name = name
            self.inits.append(value)
        else:
            self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], **attrs) -> None:
        self._n += 1
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{op}_{self._n}", **attrs))


def build_qdq(float_path: Path, ranges: dict, form: Form) -> onnx.ModelProto:
    src = onnx.load(str(float_path))
    g = src.graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    ranges = dict(ranges)
    nodes = list(g.node)
    graph_outputs = {o.name for o in g.output}

    alias: dict[str, str] = {}
    if form.relu == "drop":
        assert form.add == "qdq" and form.clip4 == "none", "relu=drop only with add=qdq"
        for n in nodes:
            if n.op_type == "Relu":
                alias[n.output[0]] = n.input[0]
                ranges[n.input[0]] = (0.0, ranges[n.output[0]][1])
        nodes = [n for n in nodes if n.op_type != "Relu"]

    def A(t: str) -> str:
        while t in alias:
            t = alias[t]
        return t

    def wants_dq(n: onnx.NodeProto, i: int) -> bool:
        """Does input i of node n read the dequantized (DQ) tensor rather than the float one?"""
        op = n.op_type
        if op == "Conv":
            return i == 0
        if op == "Relu":
            return form.relu == "split"
        if op == "MaxPool":
            return form.maxpool == "qdq"
        if op == "Add":
            if form.add == "qdq":
                return True
            if form.add == "float_in":  # input 0 is the conv branch, input 1 the identity
                return i == 1
            return False
        if op in ("GlobalAveragePool", "ReduceMean", "Flatten", "Reshape"):
            return form.head == "qdq" and i == 0
        if op == "Gemm":
            return i == 0 and form.head != "float" and form.fc != "float"
        return False

    quantized: set[str] = set()
    for n in nodes:
        for i, t in enumerate(n.input):
            if t and t not in inits and wants_dq(n, i):
                quantized.add(A(t))
    fc_node = next(n for n in nodes if n.op_type == "Gemm")
    if form.fc == "gemm_q":
        quantized.add(fc_node.output[0])

    w = _Writer()
    qp: dict[str, tuple[float, int]] = {}  # tensor -> (scale, zero point)
    dq_name: dict[str, str] = {}
    # a quantized graph output: the producer writes "<name>__f", the DQ writes "<name>"
    rename = {t: f"{t}__f" for t in quantized & graph_outputs}

    def emit_qdq(t: str, params: tuple[float, int], clip: bool) -> None:
        scale, zp = params
        qp[t] = params
        s = w.init(f"{t}__s", np.float32(scale))
        if form.act == "u4":
            z = w.init(f"{t}__z", helper.make_tensor("z", TensorProto.UINT4, [], [zp]))
        else:
            z = w.init(f"{t}__z", NPTYPE[form.act](zp))
        src_t = rename.get(t, t)
        if clip and form.clip4 == "float":
            lo_c = w.init(f"{t}__cmin", np.float32(0.0))
            hi_c = w.init(f"{t}__cmax", np.float32(15 * scale))
            w.node("Clip", [src_t, lo_c, hi_c], [f"{t}__clipf"])
            src_t = f"{t}__clipf"
        w.node("QuantizeLinear", [src_t, s, z], [f"{t}__q"])
        q_t = f"{t}__q"
        if clip and form.clip4 == "int":
            lo_c = w.init(f"{t}__cmin", np.uint8(0))
            hi_c = w.init(f"{t}__cmax", np.uint8(15))
            w.node("Clip", [q_t, lo_c, hi_c], [f"{t}__qc"])
            q_t = f"{t}__qc"
        dq_out = t if t in graph_outputs else f"{t}__dq"
        w.node("DequantizeLinear", [q_t, s, z], [dq_out])
        dq_name[t] = dq_out

    n_pairs: collections.Counter = collections.Counter()

    def dq_for_consumer(t: str) -> str:
        n_pairs[t] += 1
        if not form.dedicated_q or n_pairs[t] == 1:
            return dq_name[t]
        assert form.clip4 == "none"
        k, s, z = n_pairs[t], f"{t}__s", f"{t}__z"
        w.node("QuantizeLinear", [rename.get(t, t), s, z], [f"{t}__q{k}"])
        w.node("DequantizeLinear", [f"{t}__q{k}", s, z], [f"{t}__dq{k}"])
        return f"{t}__dq{k}"

    def new_params(t: str) -> tuple[tuple[float, int], bool]:
        lo, hi = ranges[t]
        if form.clip4 != "none" and lo >= 0 and t != "input":
            assert form.act == "u8"
            return (max(hi, 1e-8) / 15.0, 0), True
        return act_qparams(lo, hi, form.act, form.act_sym), False

    def weight_dq(name: str, wt: np.ndarray, axis: int) -> tuple[str, np.ndarray]:
        q, scale, zp = quant_weight(wt, form, axis)
        attrs = {"axis": axis} if form.w_per_channel else {}
        s = w.init(f"{name}__s", scale)
        z = w.init(f"{name}__z", zp)
        if form.w_form == "int":
            qname = w.init(f"{name}__q", q)
        else:
            f = w.init(f"{name}__f", wt.astype(np.float32))
            qname = f"{name}__q"
            w.node("QuantizeLinear", [f, s, z], [qname], **attrs)
        w.node("DequantizeLinear", [qname, s, z], [f"{name}__dq"], **attrs)
        return f"{name}__dq", scale

    def bias_in(name: str, b: np.ndarray, x_t: str | None, w_scale: np.ndarray) -> str:
        if form.bias == "float" or x_t is None:
            return w.init(f"{name}__bf", b.astype(np.float32))
        s_b = (qp[x_t][0] * w_scale).astype(np.float32)
        qb = np.round(b / s_b).astype(np.int32)
        attrs = {"axis": 0} if s_b.ndim == 1 else {}
        s = w.init(f"{name}__bs", s_b)
        z = w.init(f"{name}__bz", np.zeros_like(s_b, dtype=np.int32))
        q = w.init(f"{name}__bq", qb)
        w.node("DequantizeLinear", [q, s, z], [f"{name}__bdq"], **attrs)
        return f"{name}__bdq"

    if "input" in quantized:
        params, clip = new_params("input")
        emit_qdq("input", params, clip)

    for n in nodes:
        ins = []
        for i, t in enumerate(n.input):
            t = A(t)
            if t in inits or not t:
                ins.append(t)
            elif wants_dq(n, i):
                ins.append(dq_for_consumer(t))
            else:
                ins.append(rename.get(t, t))
        outs = [rename.get(o, o) for o in n.output]
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        x_t = A(n.input[0]) if n.input and wants_dq(n, 0) else None
        if n.op_type == "Conv":
            wq, ws = weight_dq(n.input[1], inits[n.input[1]], 0)
            ins[1] = wq
            if len(n.input) > 2:
                ins[2] = bias_in(n.input[2], inits[n.input[2]], x_t, ws)
            w.node("Conv", ins, outs, **attrs)
        elif n.op_type == "Gemm":
            wt, b = inits[n.input[1]], inits[n.input[2]]
            if attrs.get("transB", 0) == 0:
                wt = wt.T
            if form.fc == "float" or form.head == "float":
                ins[1] = w.init(f"{n.input[1]}__wf", wt.astype(np.float32))
                ins[2] = w.init(f"{n.input[2]}__bf", b.astype(np.float32))
                w.node("Gemm", ins, outs, transB=1)
            elif form.fc == "matmul":
                wq, ws = weight_dq(n.input[1], np.ascontiguousarray(wt.T), 1)
                w.node("MatMul", [ins[0], wq], [f"{outs[0]}__mm"])
                w.node("Add", [f"{outs[0]}__mm", w.init(f"{n.input[2]}__bf", b)], outs)
            else:
                wq, ws = weight_dq(n.input[1], wt, 0)
                w.node("Gemm", [ins[0], wq, bias_in(n.input[2], b, x_t, ws)], outs, transB=1)
        else:
            w.node(n.op_type, ins, outs, domain=n.domain or None, **attrs)
        for o in n.output:
            if o not in quantized:
                continue
            share = n.op_type in ("MaxPool", "Flatten", "Reshape") and x_t is not None
            if share:
                emit_qdq(o, qp[x_t], False)
            else:
                emit_qdq(o, *new_params(o))

    used = {i for n in w.nodes for i in n.input}
    passthrough = [i for i in g.initializer if i.name in used]  # e.g. the Reshape shape
    graph = helper.make_graph(
        w.nodes, "resnet18_qdq", list(g.input), list(g.output), passthrough + w.inits
    )
    model = helper.make_model(graph, opset_imports=list(src.opset_import))
    model.ir_version = src.ir_version
    onnx.checker.check_model(model)
    return model


# --------------------------------------------------------------------------------------------
# quantize_static references
# --------------------------------------------------------------------------------------------


def quantize_static_ref(
    float_path: Path, out: Path, batches, fmt: str, act: str, wt: str, per_channel: bool
) -> Path:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"input": b} for b in batches])

        def get_next(self):
            return next(self.it, None)

    qt = {"u8": QuantType.QUInt8, "s8": QuantType.QInt8}
    quantize_static(
        str(float_path),
        str(out),
        Reader(),
        quant_format=QuantFormat.QDQ if fmt == "qdq" else QuantFormat.QOperator,
        activation_type=qt[act],
        weight_type=qt[wt],
        per_channel=per_channel,
    )
    return out


# --------------------------------------------------------------------------------------------
# Runtimes
# --------------------------------------------------------------------------------------------


def op_summary(model: onnx.ModelProto) -> str:
    short = {"": "", "ai.onnx": "", "com.microsoft": "ms.", "com.microsoft.nchwc": "nchwc."}
    c = collections.Counter(
        short.get(n.domain, n.domain + ".") + n.op_type for n in model.graph.node
    )
    return ", ".join(f"{k}x{v}" for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


SPIN = {"session.intra_op.allow_spinning": "0"}


def ort_session(
    path: Path,
    opt_path: Path | None,
    config: dict,
    profile: str | None = None,
    level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
):
    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = level
    so.log_severity_level = 3
    if opt_path is not None:
        so.optimized_model_filepath = str(opt_path)
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    for k, v in {**SPIN, **config}.items():
        so.add_session_config_entry(k, v)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def ort_profile(path: Path, config: dict, x: np.ndarray, prefix: str, runs: int = 5) -> dict:
    sess = ort_session(path, None, config, profile=prefix)
    for _ in range(2 + runs):
        sess.run(None, {"input": x})
    trace = json.loads(Path(sess.end_profiling()).read_text())
    per_op: collections.Counter = collections.Counter()
    for ev in trace:
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
            per_op[ev["args"]["op_name"]] += ev["dur"]
    total_runs = 2 + runs
    return {k: round(v / 1000 / total_runs, 2) for k, v in per_op.most_common(8)}


def ov_summary(compiled) -> str:
    c: collections.Counter = collections.Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        lt = rt["layerType"].astype(str)
        if lt in ("Input", "Output", "Const", "Parameter", "Result"):
            continue
        prec = rt["runtimePrecision"].astype(str) if "runtimePrecision" in rt else "?"
        c[f"{lt}:{prec}"] += 1
    return ", ".join(f"{k}x{v}" for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


_OV_PROBE = """
import sys, numpy as np, openvino as ov
cm = ov.Core().compile_model(sys.argv[1], "CPU", {"INFERENCE_NUM_THREADS": 1})
cm.create_infer_request().infer({0: np.zeros(cm.input(0).shape, np.float32)})
"""


def ov_probe(path: Path) -> str | None:
    """Compile+infer in a child process first: OpenVINO can crash the process on some graphs."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _OV_PROBE, str(path)], capture_output=True, text=True, timeout=600
    )
    if r.returncode == 0:
        return None
    lines = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
    return f"exit {r.returncode}: " + (lines[-1][:300] if lines else "")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def _busy_jiffies() -> int:
    """Busy jiffies of the whole machine (all CPUs, steal included) from /proc/stat."""
    f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return f[0] + f[1] + f[2] + f[5] + f[6] + f[7]  # user nice system irq softirq steal


def bench(runners: dict, rounds: int, warmup: int, gap_s: float, slow_key=None) -> dict:
    """Warm up each runner, then time them interleaved (rotating start) for `rounds` rounds.

    Per sample: wall ms, process CPU ms (all our threads; with ORT spinning off this is the work
    done, and it is far less sensitive to other processes than wall time), and `other`: the CPU
    share other processes (and hypervisor steal) took during the sample. Variants slower than
    3x `slow_key` stop after 10 rounds to bound the runtime.
    """
    hz = os.sysconf("SC_CLK_TCK")
    ncpu = os.cpu_count() or 1
    names = list(runners)
    for name in names:
        for _ in range(warmup):
            runners[name]()
    res: dict = {n: {"wall": [], "cpu": [], "other": []} for n in names}
    for r in range(rounds):
        if r == 10 and slow_key in res:
            ref = statistics.median(res[slow_key]["wall"])
            names = [n for n in names if statistics.median(res[n]["wall"]) < 3 * ref]
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            time.sleep(gap_s)  # let the previous runtime's workers park
            b0, c0, t0 = _busy_jiffies(), time.process_time(), time.perf_counter()
            runners[name]()
            dt, cpu, b1 = time.perf_counter() - t0, time.process_time() - c0, _busy_jiffies()
            others = max(0.0, (b1 - b0) / hz - cpu) / (ncpu * max(dt, 1e-3))
            res[name]["wall"].append(dt * 1000)
            res[name]["cpu"].append(cpu * 1000)
            res[name]["other"].append(min(1.0, others))
    return res


def stats(m: dict, quiet: float = 0.1) -> dict:
    ts, other = m["wall"], m["other"]
    q = [t for t, o in zip(ts, other, strict=True) if o < quiet]
    return {
        "median": round(statistics.median(ts), 2),
        "min": round(min(ts), 2),
        "max": round(max(ts), 2),
        "n": len(ts),
        "cpu_median": round(statistics.median(m["cpu"]), 2),
        "quiet_median": round(statistics.median(q), 2) if len(q) >= 3 else None,
        "quiet_n": len(q),
        "other_cpu_median": round(statistics.median(other), 2),
        "raw": [round(t, 2) for t in ts],
        "raw_cpu": [round(t, 2) for t in m["cpu"]],
        "other_cpu": [round(o, 2) for o in other],
    }


# --------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------

INT8_ON = {"session.qdqisint8allowed": "1"}


def variants() -> list[dict]:
    """Each variant: name, group, how to make the model, ORT session config."""
    B = Form()
    R = dataclasses.replace
    v = [
        ("fp32", "base", {"float": 17}, {}),
        ("qdq u8 act / s8 w per-channel narrow (reference form)", "base", {"form": B}, {}),
        # 1. data types
        ("act s8 (asym zp)", "dtype", {"form": R(B, act="s8")}, {}),
        (
            "act s8 (asym zp) + session.qdqisint8allowed=1",
            "dtype",
            {"form": R(B, act="s8")},
            INT8_ON,
        ),
        (
            "act s8, dedicated Q->DQ per consumer",
            "dtype",
            {"form": R(B, act="s8", dedicated_q=True)},
            {},
        ),
        ("act s8 symmetric zp=0", "dtype", {"form": R(B, act="s8", act_sym=True)}, {}),
        (
            "act s8 symmetric zp=0 + qdqisint8allowed=1",
            "dtype",
            {"form": R(B, act="s8", act_sym=True)},
            INT8_ON,
        ),
        ("w s8 per-channel full [-128,127]", "dtype", {"form": R(B, w_range="full")}, {}),
        ("w s8 per-tensor", "dtype", {"form": R(B, w_per_channel=False)}, {}),
        ("w u8 per-channel (zp=128)", "dtype", {"form": R(B, w="u8")}, {}),
        (
            "w float initializer -> Q -> DQ (fake-quant weights)",
            "dtype",
            {"form": R(B, w_form="fq")},
            {},
        ),
        # 2. placement
        ("Add: conv branch enters Add in float", "placement", {"form": R(B, add="float_in")}, {}),
        ("Add: both inputs float (no QLinearAdd)", "placement", {"form": R(B, add="float")}, {}),
        (
            "MaxPool in float (stem conv output not quantized)",
            "placement",
            {"form": R(B, maxpool="float")},
            {},
        ),
        ("Relu split: Conv->Q->DQ->Relu->Q", "placement", {"form": R(B, relu="split")}, {}),
        (
            "Relu dropped (Q zp=0 range [0,max] does the ReLU)",
            "placement",
            {"form": R(B, relu="drop")},
            {},
        ),
        (
            "head: GAP+Flatten float, Q before Gemm",
            "placement",
            {"form": R(B, head="gap_float")},
            {},
        ),
        ("head: GAP+Flatten+Gemm all float", "placement", {"form": R(B, head="float")}, {}),
        ("fc: Gemm->Q->DQ (quantized logits)", "placement", {"form": R(B, fc="gemm_q")}, {}),
        ("fc: MatMul(DQ w) + float Add", "placement", {"form": R(B, fc="matmul")}, {}),
        ("fc: float Gemm (weights float)", "placement", {"form": R(B, fc="float")}, {}),
        # 3. bias
        ("bias float initializer (not int32+DQ)", "bias", {"form": R(B, bias="float")}, {}),
        # 4. narrow-range activations
        ("4-bit act: u8 Q -> Clip[0,15] (integer) -> DQ", "clip", {"form": R(B, clip4="int")}, {}),
        ("4-bit act: Clip(0,15s) in float -> Q", "clip", {"form": R(B, clip4="float")}, {}),
        ("4-bit act: uint4 Q/DQ (opset 21)", "clip", {"form": R(B, act="u4"), "opset": 21}, {}),
        # 5. opset
        ("opset 13", "opset", {"form": B, "opset": 13}, {}),
        ("opset 21", "opset", {"form": B, "opset": 21}, {}),
        (
            "dynamo export (opset 18: ReduceMean+Reshape head)",
            "opset",
            {"form": B, "dynamo": True},
            {},
        ),
        # references
        ("quantize_static QDQ u8/s8 per-channel", "ref", {"qs": ("qdq", "u8", "s8", True)}, {}),
        (
            "quantize_static QDQ defaults (s8/s8 per-tensor)",
            "ref",
            {"qs": ("qdq", "s8", "s8", False)},
            {},
        ),
        ("quantize_static QOperator u8/s8", "ref", {"qs": ("qop", "u8", "s8", False)}, {}),
        ("quantize_static QOperator s8/s8", "ref", {"qs": ("qop", "s8", "s8", False)}, {}),
    ]
    return [{"name": n, "group": g, "make": m, "config": c} for n, g, m, c in v]


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")[:60]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gap", type=float, default=0.02, help="sleep between timed runs (s)")
    ap.add_argument("--no-ov", action="store_true")
    ap.add_argument(
        "--boost",
        action="store_true",
        help="raise this process' scheduling priority"
        " (new session, autogroup nice -10; needs root) on a shared machine",
    )
    ap.add_argument(
        "--spin",
        action="store_true",
        help="keep ORT intra-op spinning on (default off:"
        " on a shared 2-core machine spinning workers amplify contention)",
    )
    ap.add_argument("--only", default=None, help="regex on variant names (fp32 always kept)")
    ap.add_argument(
        "--profile",
        default="reference form|act s8 \\(asym zp\\)|float_in|bias float|"
        "Relu split|Clip\\(0,15s\\)|both inputs float|defaults",
    )
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    t_start = time.time()
    if args.spin:
        SPIN.clear()
    boost = boost_priority() if args.boost else "off"
    work = args.workdir or Path(tempfile.mkdtemp(prefix="forms_study_"))
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

    vs = variants()
    if args.only:
        vs = [v for v in vs if v["name"] == "fp32" or re.search(args.only, v["name"])]

    rng = np.random.default_rng(SEED)
    calib = [rng.standard_normal((BATCH, 3, 224, 224), dtype=np.float32) for _ in range(4)]
    x_test = rng.standard_normal((BATCH, 3, 224, 224), dtype=np.float32)

    print(f"[{time.time() - t_start:5.1f}s] building model + exports in {work}")
    model = make_model()
    floats: dict = {}

    def float_path(opset: int, dynamo: bool = False) -> Path:
        key = (opset, dynamo)
        if key not in floats:
            floats[key] = export(
                model, work / f"float_op{opset}{'_dyn' if dynamo else ''}.onnx", opset, dynamo
            )
        return floats[key]

    ranges = tensor_ranges(float_path(17), calib)
    ranges_dyn = None

    for v in vs:
        mk, path = v["make"], work / f"{slug(v['name'])}.onnx"
        if "float" in mk:
            path = float_path(mk["float"])
        elif "qs" in mk:
            quantize_static_ref(float_path(17), path, calib, *mk["qs"])
        elif mk.get("dynamo"):
            fp = float_path(18, dynamo=True)
            ranges_dyn = ranges_dyn or tensor_ranges(fp, calib)
            onnx.save(build_qdq(fp, ranges_dyn, mk["form"]), str(path))
        else:
            op = mk.get("opset", 17)
            fp = float_path(op)
            r = ranges if op == 17 else tensor_ranges(fp, calib)
            onnx.save(build_qdq(fp, r, mk["form"]), str(path))
        v["path"] = path
    print(f"[{time.time() - t_start:5.1f}s] {len(vs)} models written")

    # ---- ORT sessions, optimized-graph op counts, accuracy sanity
    runners = {}
    ref_out = None
    for v in vs:
        opt = work / f"{slug(v['name'])}.ort_opt.onnx"
        try:
            sess = ort_session(v["path"], opt, v["config"])
        except Exception as e:  # noqa: BLE001 - report, then retry without the QDQ fusions
            v["ort_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print("ORT failed:", v["name"], v["ort_error"])
            try:
                sess = ort_session(
                    v["path"], opt, v["config"], level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
                )
                v["ort_level"] = "ORT_ENABLE_BASIC (ENABLE_ALL failed)"
            except Exception as e2:  # noqa: BLE001
                v["ort_error"] += f" | BASIC: {type(e2).__name__}: {str(e2)[:200]}"
                continue
        v["ort_ops"] = op_summary(onnx.load(str(opt)))
        y = sess.run(None, {"input": x_test})[0]
        if ref_out is None:
            ref_out = y
        v["cos_vs_fp32"] = round(cosine(y, ref_out), 4)
        runners[("ort", v["name"])] = lambda s=sess: s.run(None, {"input": x_test})
    print(f"[{time.time() - t_start:5.1f}s] {len(runners)} ORT sessions ready")

    # ---- OpenVINO
    ov_info: dict = {}
    if not args.no_ov:
        import openvino as ov

        core = ov.Core()
        cfg = {"INFERENCE_NUM_THREADS": THREADS, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
        ov_info = {
            "version": ov.__version__,
            "default_inference_precision": str(
                core.get_property("CPU", "INFERENCE_PRECISION_HINT")
            ),
        }
        seen = set()
        for v in vs:
            if v["config"] or str(v["path"]) in seen:
                continue  # ORT-only session options
            seen.add(str(v["path"]))
            hints = [("", {})]
            if v["name"] == "fp32":
                hints = [
                    (" [OV default precision]", {}),
                    (" [OV f32 forced]", {"INFERENCE_PRECISION_HINT": "f32"}),
                ]
            err = ov_probe(v["path"])
            if err:
                v["ov_error"] = err
                print("OV failed:", v["name"], err)
                continue
            for suffix, extra in hints:
                try:
                    cm = core.compile_model(str(v["path"]), "CPU", {**cfg, **extra})
                except Exception as e:  # noqa: BLE001
                    v["ov_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print("OV failed:", v["name"], v["ov_error"])
                    continue
                req = cm.create_infer_request()
                y = req.infer({0: x_test})[0]
                v.setdefault("ov", {})[suffix] = {
                    "ops": ov_summary(cm),
                    "cos_vs_fp32": round(cosine(y, ref_out), 4),
                }
                runners[("ov" + suffix, v["name"])] = lambda r=req: r.infer({0: x_test})
        print(f"[{time.time() - t_start:5.1f}s] OV models compiled")

    # ---- timing
    res = bench(runners, args.rounds, args.warmup, args.gap, slow_key=("ort", "fp32"))
    print(f"[{time.time() - t_start:5.1f}s] timing done")
    base = stats(res[("ort", "fp32")])
    for (rt, name), m in res.items():
        v = next(x for x in vs if x["name"] == name)
        stat = stats(m)
        if rt == "ort":
            v["ort_ms"] = stat
            v["ratio_cpu_vs_fp32"] = round(stat["cpu_median"] / base["cpu_median"], 3)
            v["ratio_min_vs_fp32_min"] = round(stat["min"] / base["min"], 3)
        else:
            v["ov"][rt[2:]]["ms"] = stat

    # ---- kernel-time breakdown for a few variants
    if args.profile:
        for v in vs:
            if re.search(args.profile, v["name"]) and "ort_ms" in v:
                v["ort_profile_ms_per_run"] = ort_profile(
                    v["path"], v["config"], x_test, str(work / f"prof_{slug(v['name'])}")
                )

    env = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "isa": sorted(
            {f for f in _cpu_flags() if re.match(r"(avx512_vnni|avx_vnni|amx|avx512_bf16)", f)}
        ),
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "threads": THREADS,
        "batch": BATCH,
        "rounds": args.rounds,
        "openvino": ov_info,
        "ort_session_config": SPIN,
        "priority_boost": boost,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "runtime_s": round(time.time() - t_start, 1),
    }
    rows = [
        {k: val for k, val in v.items() if k not in ("make", "path")} | {"make": repr(v["make"])}
        for v in vs
    ]
    (args.out / "results.json").write_text(json.dumps({"env": env, "variants": rows}, indent=1))
    md = render(env, vs)
    (args.out / "results.md").write_text(md)
    print(md)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _fmt(stat: dict | None) -> str:
    if not stat:
        return "-"
    quiet = f" q{stat['quiet_median']:.1f}" if stat.get("quiet_median") else ""
    return f"{stat['median']:.1f} [{stat['min']:.1f}-{stat['max']:.1f}]{quiet} | {stat['cpu_median']:.1f}"


def render(env: dict, vs: list[dict]) -> str:
    out = [
        f"env: {json.dumps(env)}",
        "",
        "wall ms: median [min-max] over all samples (qN: median over samples where other processes"
        " used <10% of the CPUs); CPU ms: median process CPU time per run (both threads);"
        " x fp32: CPU-median ratio, wall-min ratio vs ORT fp32.",
        "",
        "| group | variant | ORT wall ms | ORT CPU ms | x fp32 (CPU, min) | cos | ORT ops after optimization |"
        " OV wall ms | OV CPU ms | OV runtime layers |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in vs:
        ov_items = list(v.get("ov", {}).items())
        ov_ms = _fmt(ov_items[0][1].get("ms")) if ov_items else v.get("ov_error", "-")[:60] + " | -"
        ov_ops = f"{ov_items[0][1]['ops']}{ov_items[0][0]}" if ov_items else "-"
        ort_cell = _fmt(v.get("ort_ms")) if "ort_ms" in v else v.get("ort_error", "-")[:80] + " | -"
        if v.get("ort_level"):
            ort_cell += f" ({v['ort_level']})"
        out.append(
            f"| {v['group']} | {v['name']} | {ort_cell} | {v.get('ratio_cpu_vs_fp32', '-')}, "
            f"{v.get('ratio_min_vs_fp32_min', '-')} | {v.get('cos_vs_fp32', '-')} | "
            f"{v.get('ort_ops', '-')} | {ov_ms} | {ov_ops} |"
        )
        for k, d in ov_items[1:]:
            out.append(
                f"| {v['group']} | {v['name']}{k} | (ORT: row above) | | | {d['cos_vs_fp32']} | | "
                f"{_fmt(d.get('ms'))} | {d['ops']} |"
            )
    prof = [v for v in vs if v.get("ort_profile_ms_per_run")]
    if prof:
        out += ["", "ORT kernel time per run (ms, top op types):", ""]
        for v in prof:
            out.append(
                f"- {v['name']}: "
                + ", ".join(f"{k} {t}" for k, t in v["ort_profile_ms_per_run"].items())
            )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
