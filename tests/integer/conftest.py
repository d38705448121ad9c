"""Helpers of the integer-program tests: small QDQ graphs built by hand, and the layer-wise
comparison with ONNX Runtime (each layer fed the program's own integer inputs)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

if importlib.util.find_spec("quantbridge") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

OPSET = 21


class QDQGraph:
    """A float input quantized once, then nodes added one by one; ``quant`` inserts a Q -> DQ."""

    def __init__(self, shape, scale=0.05, zero=3, dtype=np.uint8, seed=0):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.k = [], [], 0
        self.inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))]
        self.x = self.quant("x", scale, zero, dtype)

    def _name(self, base: str) -> str:
        self.k += 1
        return f"{base}_{self.k}"

    def const(self, array, base="c") -> str:
        name = self._name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(self, op: str, inputs, n_out=1, **attrs) -> str:
        outs = [self._name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=outs[0], **attrs))
        return outs[0]

    def node_outputs(self, op: str, inputs, n_out: int, **attrs) -> list[str]:
        outs = [self._name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=outs[0], **attrs))
        return outs

    def quant(self, name, scale, zero, dtype=np.uint8) -> str:
        s, z = self.const(np.float32(scale), "s"), self.const(np.array(zero, dtype), "z")
        return self.node("DequantizeLinear", [self.node("QuantizeLinear", [name, s, z]), s, z])

    def weight(self, shape, scale=0.02, axis=0, per_channel=True, low=-127, high=128) -> str:
        q = self.rng.integers(low, high, size=shape).astype(np.int8)
        if per_channel:
            s = (scale * self.rng.uniform(0.5, 1.5, shape[axis])).astype(np.float32)
            z = np.zeros(shape[axis], np.int8)
        else:
            s, z = np.float32(scale), np.int8(0)
        return self.node("DequantizeLinear", [self.const(q, "w"), self.const(s), self.const(z)],
                         axis=axis)  # fmt: skip

    def bias(self, n, acc_scale) -> str:
        q = self.rng.integers(-3000, 3000, size=n).astype(np.int32)
        s = np.broadcast_to(np.float32(acc_scale), (n,)).astype(np.float32)
        return self.node("DequantizeLinear", [self.const(q, "b"), self.const(s),
                                              self.const(np.zeros(n, np.int32))], axis=0)  # fmt: skip

    def model(self, *outputs: str) -> onnx.ModelProto:
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
        graph = helper.make_graph(self.nodes, "g", self.inputs, outs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 10
        return model


def ort_session(model: onnx.ModelProto, optimize: bool = False) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def layerwise_lsb(model: onnx.ModelProto, prog, feeds: dict, optimize: bool = False,
                  cut_ops=("QuantizeLinear",)):  # fmt: skip
    """``|program - ORT|`` in codes at every activation QuantizeLinear (or other op of
    ``cut_ops``: a QOperator file's QLinearConv, QLinearAdd ...), ORT computing each layer from
    the program's own integer codes (the graph is cut there). Returns
    ``{onnx output: abs difference array}``."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    graph_inputs = {i.name for i in m.graph.input}
    cut = []
    for n in m.graph.node:
        # a QuantizeLinear the lowering folded (of a constant: a token-type embedding) has no
        # program tensor and nothing to compare
        folded = n.output[0] not in prog.onnx_tensors
        if n.op_type in cut_ops and n.input[0] not in graph_inputs and not folded:
            cut.append(n.output[0])
            n.output[0] += "__ort"
    del m.graph.output[:]
    env = prog.run_integer(feeds)
    for o in cut:
        t = prog.tensors[prog.onnx_tensors[o]]
        dtype = helper.np_dtype_to_tensor_dtype(t.dtype)
        m.graph.input.append(helper.make_tensor_value_info(o, dtype, None))
        m.graph.output.append(helper.make_empty_tensor_value_info(o + "__ort"))
    sess = ort_session(m, optimize)
    wanted = {i.name for i in sess.get_inputs()}
    all_feeds = {**feeds, **{o: env[prog.onnx_tensors[o]] for o in cut}}
    got = sess.run([o + "__ort" for o in cut], {k: v for k, v in all_feeds.items() if k in wanted})
    return {
        o: np.abs(env[prog.onnx_tensors[o]].astype(np.int64) - r.astype(np.int64))
        for o, r in zip(cut, got, strict=True)
    }


@pytest.fixture
def qdq_graph():
    return QDQGraph


@pytest.fixture
def layerwise():
    return layerwise_lsb


C_TYPES = {"int8": "int8_t", "uint8": "uint8_t", "int16": "int16_t", "uint16": "uint16_t",
           "int64": "int64_t",
           "int32": "int32_t"}  # fmt: skip


def run_c_program(prog, feeds: dict, directory: Path, opt: str = "-O0") -> dict:
    """Emit ``prog`` as C into ``directory``, compile it with gcc and a main that reads the input
    codes from stdin and writes the output codes; returns {output name: codes}."""
    import shutil
    import subprocess

    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    shapes = {b.name: np.asarray(feeds[b.name]).shape for b in prog.inputs}
    prog.emit_c(directory, shapes)
    env = prog.run_integer(feeds)
    decls, reads, args, writes = [], [], [], []
    for i, b in enumerate(prog.inputs):
        decls.append(f"static {C_TYPES[b.tensor.dtype.name]} in{i}[QB_IN{i}_SIZE];")
        reads.append(f"if (fread(in{i}, 1, sizeof in{i}, stdin) != sizeof in{i}) return 1;")
        args.append(f"in{i}")
    for i, b in enumerate(prog.outputs):
        decls.append(f"static {C_TYPES[b.tensor.dtype.name]} out{i}[QB_OUT{i}_SIZE];")
        args.append(f"out{i}")
        writes.append(f"fwrite(out{i}, 1, sizeof out{i}, stdout);")
    main = "\n".join(["#include <stdio.h>", '#include "qb_model.h"', *decls, "int main(void) {",
                      *reads, f"qb_run({', '.join(args)});", *writes, "return 0; }"])  # fmt: skip
    (directory / "main.c").write_text(main)
    exe = directory / "run"
    subprocess.run(["gcc", "-std=c99", *opt.split(), "-Wall", "-Werror", "-o", str(exe),
                    str(directory / "main.c"), str(directory / "qb_model.c")], check=True)  # fmt: skip
    stdin = b"".join(env[b.tensor.name].tobytes() for b in prog.inputs)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, check=True).stdout
    result, offset = {}, 0
    for b in prog.outputs:
        ref = env[b.tensor.name]
        result[b.name] = np.frombuffer(out[offset : offset + ref.nbytes], ref.dtype).reshape(
            ref.shape
        )
        offset += ref.nbytes
    return result


@pytest.fixture
def run_c():
    return run_c_program


def assert_three_emitters_agree(prog, feeds: dict, directory: Path, integer_only: bool = True):
    """numpy, C (gcc) and the integer ONNX model in ONNX Runtime give the same output codes on
    ``feeds``; with ``integer_only`` the ONNX model also holds no float initializer and none of the
    float ops an integer program replaces."""
    env = prog.run_integer(feeds)
    expected = prog.run(feeds, integer=True)
    got_c = run_c_program(prog, feeds, directory / "c")
    shapes = {b.name: np.asarray(feeds[b.name]).shape for b in prog.inputs}
    integer_model = prog.save_onnx(directory / "int.onnx", shapes)
    if integer_only:
        float_types = {1, 10, 11, 16}
        assert all(t.data_type not in float_types for t in integer_model.graph.initializer)
        assert {n.op_type for n in integer_model.graph.node}.isdisjoint(
            {"Softmax", "LayerNormalization", "Sqrt", "Exp", "Erf", "QuantizeLinear"}
        )
    sess = ort.InferenceSession(str(directory / "int.onnx"), providers=["CPUExecutionProvider"])
    got_onnx = sess.run(None, {b.tensor.name: env[b.tensor.name] for b in prog.inputs})
    for b, codes in zip(prog.outputs, got_onnx, strict=True):
        np.testing.assert_array_equal(codes, expected[b.name])
        np.testing.assert_array_equal(got_c[b.name], expected[b.name])


@pytest.fixture
def three_emitters():
    return assert_three_emitters_agree


@pytest.fixture
def node_by_node():
    """``ort_session`` (node by node unless ``optimize``) for test files: a function-level
    ``from conftest import`` gets whichever conftest the whole suite loaded last."""
    return ort_session
