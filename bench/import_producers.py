"""INT8 ONNX files as other tools write them, for ``bench.import_sweep`` (never run by CI).

Float models (exported by torch's TorchScript exporter, one input ``x``), then per file a producer
setting: ONNX Runtime ``quantize_static`` / ``quantize_dynamic`` / ``quant_pre_process``, NNCF and
NVIDIA ModelOpt (each in its own environment, through ``bench.suite.peer_child``), and hand edits
of a QDQ file into forms real files have (other opsets, 1-element or missing zero points, Q/DQ
parameters and weights in Constant nodes, DQ -> Transpose / Reshape -> MatMul weight chains,
blocked DequantizeLinear, external data).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import nn

from quantbridge import zoo

from .suite.peer_child import save_batches

ROOT = Path(__file__).resolve().parents[1]


class RNN(nn.Module):
    """LSTM -> GRU -> Linear on [batch, time, features]."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.gru(self.lstm(x)[0])[0][:, -1])


class UpConv(nn.Module):
    """Conv -> ConvTranspose (x2) -> Resize (nearest x2) -> Concat with a skip -> Conv."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, stride=4, padding=1)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.skip = nn.Conv2d(3, 4, 1)
        self.out = nn.Conv2d(12, 6, 3, padding=1)

    def forward(self, x):
        u = nn.functional.interpolate(torch.relu(self.up(torch.relu(self.down(x)))), scale_factor=2)
        return self.out(torch.cat([u, torch.relu(self.skip(x))], 1))


class TokenTransformer(nn.Module):
    """zoo.TinyTransformer (MiniLM-like: embedding, 2 post-LN encoder blocks, mean, head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = zoo.TinyTransformer(vocab=100, dim=32, heads=4, layers=2, ff=64)

    def forward(self, x):
        return self.net(x)


MODELS = {  # name -> (factory, input shape, integer tokens?)
    "resnet18": (lambda: zoo.resnet18_style(10, width=8), (3, 32, 32), False),
    "mobilenetv2": (lambda: zoo.mobilenetv2_style(10, width=0.25), (3, 32, 32), False),
    "minilm": (TokenTransformer, (16,), True),
    "rnn": (RNN, (6, 8), False),
    "upconv": (UpConv, (3, 16, 16), False),
}


def inputs(model: str, batch: int, seed: int) -> np.ndarray:
    shape, tokens = MODELS[model][1], MODELS[model][2]
    rng = np.random.default_rng(seed)
    if tokens:
        return rng.integers(0, 100, (batch, *shape)).astype(np.int64)
    return rng.standard_normal((batch, *shape)).astype(np.float32)


def calibration(model: str) -> list[np.ndarray]:
    return [inputs(model, 4, s) for s in range(4)]


def float_file(model: str, folder: Path, opset: int = 17) -> Path:
    path = folder / f"{model}_fp32_op{opset}.onnx"
    if not path.exists():
        make = MODELS[model][0]
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                make().eval(), (torch.from_numpy(inputs(model, 2, 0)),), str(path), dynamo=False,
                opset_version=opset, input_names=["x"], output_names=["y"],
                dynamic_axes={"x": {0: "b"}, "y": {0: "b"}},
            )  # fmt: skip
    return path


# -- ONNX Runtime -------------------------------------------------------------------------------
def ort_static(src: Path, dst: Path, model: str, **settings) -> Path:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._it = iter([{"x": b} for b in calibration(model)])

        def get_next(self):
            return next(self._it, None)

    kw = dict(settings)
    kw["quant_format"] = getattr(QuantFormat, kw.pop("fmt", "QDQ"))
    for key in ("activation_type", "weight_type"):
        if key in kw:
            kw[key] = getattr(QuantType, kw[key])
    if "calibrate_method" in kw:
        from onnxruntime.quantization import CalibrationMethod

        kw["calibrate_method"] = getattr(CalibrationMethod, kw["calibrate_method"])
    quantize_static(str(src), str(dst), Reader(), **kw)
    return dst


def ort_dynamic(src: Path, dst: Path, **settings) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    kw = dict(settings)
    if "weight_type" in kw:
        kw["weight_type"] = getattr(QuantType, kw["weight_type"])
    quantize_dynamic(str(src), str(dst), **kw)
    return dst


def pre_processed(src: Path, folder: Path) -> Path:
    from onnxruntime.quantization.shape_inference import quant_pre_process

    dst = folder / (src.stem + "_pre.onnx")
    if not dst.exists():
        try:
            quant_pre_process(str(src), str(dst))
        except Exception:  # "Incomplete symbolic shape inference" (Resize, LSTM): ONNX's only
            quant_pre_process(str(src), str(dst), skip_symbolic_shape=True)
    return dst


# -- peers in their own environments ------------------------------------------------------------
def peer(tool: str, config: str, src: Path, dst: Path, model: str) -> Path:
    python = os.environ.get(
        {"nncf": "QB_BENCH_NNCF_PYTHON", "modelopt": "QB_BENCH_MODELOPT_PYTHON"}[tool],
        {"nncf": "/work/venvs/peers/bin/python", "modelopt": "/work/venvs/modelopt/bin/python"}[
            tool
        ],
    )
    calib = dst.with_suffix(".calib.npz")
    save_batches(calib, [{"x": b} for b in calibration(model)])
    spec = {"tool": tool, "config": config, "float_onnx": str(src), "calib": str(calib),
            "out": str(dst)}  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [python, "-m", "bench.suite.peer_child", json.dumps(spec)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode or not dst.exists():
        raise RuntimeError(f"{tool} {config}: {done.stderr.strip().splitlines()[-1:]}")
    return dst


# -- hand edits of a QDQ file -------------------------------------------------------------------
def _consts(graph) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in graph.initializer}


def _replace_init(graph, name: str, value: np.ndarray) -> None:
    for i, init in enumerate(graph.initializer):
        if init.name == name:
            graph.initializer[i].CopyFrom(numpy_helper.from_array(value, name))
            return
    raise KeyError(name)


def set_opset(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = version
    model.ir_version = max(model.ir_version, 10 if version >= 21 else 9 if version >= 19 else 7)
    return model


def one_element_qparams(model: onnx.ModelProto) -> onnx.ModelProto:
    """Scalar scales and zero points as shape-[1] tensors (older exporters write these)."""
    g, consts = model.graph, _consts(model.graph)
    names = {n.input[i] for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
             for i in (1, 2) if len(n.input) > i and n.input[i] in consts}  # fmt: skip
    for name in names:
        if consts[name].ndim == 0:
            _replace_init(g, name, consts[name].reshape(1))
    return model


def drop_zero_points(model: onnx.ModelProto) -> onnx.ModelProto:
    """Leave out zero points that are 0 where the type stays the same (int8 weights' DQ; uint8
    activations' Q and DQ): the schema's default zero point is uint8 0, a DQ's type is its
    input's."""
    g, consts = model.graph, _consts(model.graph)
    for n in g.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(n.input) < 3:
            continue
        zp = consts.get(n.input[2])
        if zp is None or np.any(zp != 0):
            continue
        weight_dq = n.op_type == "DequantizeLinear" and n.input[0] in consts
        if zp.dtype == np.uint8 or weight_dq:
            del n.input[2]
    return model


def params_as_constant_nodes(model: onnx.ModelProto, weights: bool) -> onnx.ModelProto:
    """Scales and zero points (and, with ``weights``, the integer weights) of Q/DQ as Constant
    nodes instead of initializers (torch's dynamo exporter and hand-built graphs write these)."""
    g, consts = model.graph, _consts(model.graph)
    wanted = set()
    for n in g.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            wanted.update(i for i in n.input[1:] if i in consts)
            if weights and n.op_type == "DequantizeLinear" and n.input[0] in consts:
                wanted.add(n.input[0])
    keep = [i for i in g.initializer if i.name not in wanted]
    nodes = [helper.make_node("Constant", [], [name], name=f"const_{name}",
                              value=numpy_helper.from_array(consts[name], name))
             for name in sorted(wanted)]  # fmt: skip
    del g.initializer[:]
    g.initializer.extend(keep)
    rest = list(g.node)
    del g.node[:]
    g.node.extend(nodes + rest)
    return model


def _weight_dqs(g, consts, op_types=("MatMul",)):
    """(DQ node, consumer) for each 2-D weight DQ read by ``op_types`` as input B."""
    dq_of = {n.output[0]: n for n in g.node if n.op_type == "DequantizeLinear"}
    for n in g.node:
        if n.op_type in op_types and n.input[1] in dq_of:
            dq = dq_of[n.input[1]]
            if dq.input[0] in consts and consts[dq.input[0]].ndim == 2:
                yield dq, n


def transposed_weights(model: onnx.ModelProto, via: str = "Transpose") -> onnx.ModelProto:
    """MatMul weights as DQ(W^T) -> Transpose -> MatMul (``via="Transpose"``) or
    DQ(W[None]) -> Reshape -> MatMul (``via="Reshape"``); per-axis DQs follow the axis."""
    g, consts = model.graph, _consts(model.graph)
    for k, (dq, mm) in enumerate(list(_weight_dqs(g, consts))):
        w = consts[dq.input[0]]
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        per_axis = consts[dq.input[1]].size > 1
        if via == "Transpose":
            _replace_init(g, dq.input[0], np.ascontiguousarray(w.T))
            new_axis, extra = 1 - axis, [helper.make_node("Transpose", [f"wt{k}"], [f"wm{k}"],
                                                          name=f"w_transpose_{k}", perm=[1, 0])]  # fmt: skip
        else:
            _replace_init(g, dq.input[0], w[None])
            shape = numpy_helper.from_array(np.array(w.shape, np.int64), f"wshape{k}")
            g.initializer.append(shape)
            new_axis, extra = axis + 1, [helper.make_node("Reshape", [f"wt{k}", f"wshape{k}"],
                                                          [f"wm{k}"], name=f"w_reshape_{k}")]  # fmt: skip
        if per_axis:
            for a in dq.attribute:
                if a.name == "axis":
                    a.i = new_axis
            if not any(a.name == "axis" for a in dq.attribute):
                dq.attribute.append(helper.make_attribute("axis", new_axis))
        old = dq.output[0]
        dq.output[0] = f"wt{k}"
        mm.input[1] = f"wm{k}"
        for other in g.node:  # a shared weight DQ: every reader takes the chain's output
            other.input[:] = [f"wm{k}" if i == old else i for i in other.input]
        g.node.insert(list(g.node).index(dq) + 1, extra[0])
    return model


def blocked_weights(model: onnx.ModelProto, block: int, dtype) -> onnx.ModelProto:
    """MatMul weights [K, N] re-quantized in blocks of ``block`` along K (opset 21
    ``DequantizeLinear(axis=0, block_size)``), symmetric: s = max|w| / qmax per block."""
    g, consts = model.graph, _consts(model.graph)
    qmax = {onnx.TensorProto.INT8: 127, onnx.TensorProto.INT4: 7}[dtype]
    for k, (dq, _) in enumerate(list(_weight_dqs(g, consts))):
        scale = consts[dq.input[1]]
        zp = consts[dq.input[2]] if len(dq.input) > 2 else np.zeros_like(scale)
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        codes = consts[dq.input[0]].astype(np.float32)
        shape = [1] * codes.ndim
        if scale.size > 1:
            shape[axis] = -1
        w = (codes - zp.reshape(shape).astype(np.float32)) * scale.reshape(shape)
        kk, n = w.shape
        nb = -(-kk // block)
        pad = np.zeros((nb * block, n), np.float32)
        pad[:kk] = w
        s = np.abs(pad.reshape(nb, block, n)).max(1) / qmax
        s = np.where(s == 0, 1.0, s).astype(np.float32)
        q = np.clip(np.round(w / np.repeat(s, block, 0)[:kk]), -qmax - 1, qmax).astype(np.int8)
        names = (f"bw{k}", f"bs{k}", f"bz{k}")
        g.initializer.extend([
            helper.make_tensor(names[0], dtype, q.shape, q.flatten().tolist()),
            numpy_helper.from_array(s, names[1]),
            helper.make_tensor(names[2], dtype, s.shape, [0] * s.size),
        ])  # fmt: skip
        dq.input[:] = list(names)
        del dq.attribute[:]
        dq.attribute.extend([helper.make_attribute("axis", 0),
                             helper.make_attribute("block_size", block)])  # fmt: skip
    used = {i for n in g.node for i in n.input}
    keep = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    return set_opset(model, 21)


def save(model: onnx.ModelProto, dst: Path, external: bool = False) -> Path:
    if external:
        onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=dst.name + ".data", size_threshold=0)  # fmt: skip
    else:
        onnx.save(model, str(dst))
    return dst


if __name__ == "__main__":
    sys.exit("run python -m bench.import_sweep")
