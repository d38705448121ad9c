"""Emitters bit-exact with the numpy executor: the C99 program compiled with gcc, on every op
family case of ``test_integer_ops`` and on random inputs."""

from __future__ import annotations

import numpy as np
import pytest
from test_integer_ops import CASES, UNARY

import quantbridge as qb


def _models(qdq_graph):
    for name, (shape, build) in sorted(CASES.items()):
        g = qdq_graph(shape)
        yield name, g.model(build(g)), shape
    for name, build in sorted(UNARY.items()):
        g = qdq_graph((1, 2, 4, 4), scale=0.0312345, zero=128)
        yield name, g.model(g.quant(build(g), 0.0212345, 20)), (1, 2, 4, 4)


def test_c_program_is_bit_exact_with_executor(qdq_graph, run_c, tmp_path):
    rng = np.random.default_rng(0)
    for name, model, shape in _models(qdq_graph):
        prog = qb.lower(model)
        x = (rng.standard_normal(shape) * 2).astype(np.float32)
        got = run_c(prog, {"x": x}, tmp_path / name)
        expected = prog.run({"x": x}, integer=True)
        for out, codes in expected.items():
            np.testing.assert_array_equal(got[out], codes, err_msg=name)


def test_c_output_folder_not_writable(qdq_graph, tmp_path):
    g = qdq_graph((1, 4))
    prog = qb.lower(g.model(g.quant(g.node("Relu", [g.x]), 0.1, 0)))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match="not writable"):
        prog.emit_c(blocker / "sub")


def test_integer_onnx_is_bit_exact_in_onnx_runtime(qdq_graph, tmp_path):
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    for name, model, shape in _models(qdq_graph):
        prog = qb.lower(model)
        x = (rng.standard_normal(shape) * 2).astype(np.float32)
        path = tmp_path / f"{name}.onnx"
        integer_model = prog.save_onnx(path, {"x": shape})
        float_types = {1, 10, 11, 16}  # float, float16, double, bfloat16
        for vi in [*integer_model.graph.input, *integer_model.graph.output]:
            assert vi.type.tensor_type.elem_type not in float_types, name
        assert all(t.data_type not in float_types for t in integer_model.graph.initializer), name
        env = prog.run_integer({"x": x})
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = sess.run(None, {b.tensor.name: env[b.tensor.name] for b in prog.inputs})
        for b, codes in zip(prog.outputs, got, strict=True):
            np.testing.assert_array_equal(codes, env[b.tensor.name], err_msg=name)
