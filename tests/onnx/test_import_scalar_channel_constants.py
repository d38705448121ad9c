"""Constant operands of Add / Mul that a QDQ file stores as integers, in the two forms the import
used to read as float: a size-1 constant (``x * 0.5``, ``x + 1.0`` as ``DequantizeLinear`` of a
uint8 code) and a per-channel constant (``DequantizeLinear(codes, scales, zero points, axis=1)``
of shape (1, C, 1, 1), a per-channel scale and shift). Each imports as a ``ConstantQuantizer``
on the file's grid, and ``export(import(f))`` writes its codes, scales, zero points and axis back
bit for bit (issue 9's round trip).

The file is written by hand (no producer writes per-channel Add / Mul constants), with codes
that are not the nearest codes of round numbers, so a re-quantization of the float values on a
re-derived grid would show. Reference: ONNX Runtime with graph optimisations off (node by node,
the float arithmetic the QDQ file specifies), within 1 step of the output grid (float32
evaluation order can cross a rounding boundary; measured 0).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb
from quantbridge.torch._fakequant import ConstantQuantizer

C = 4
OUT_SCALE = 0.05


def _init(name: str, value) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _qdq_file() -> onnx.ModelProto:
    """x -> Q/DQ -> * DQ(0.5) -> Q/DQ -> + DQ(1.0) -> Q/DQ -> * DQ(gamma[c]) -> Q/DQ
    -> + DQ(beta[c]) -> Q/DQ -> y."""
    rng = np.random.default_rng(3)
    inits = [
        _init("half_q", np.uint8(201)), _init("half_s", np.float32(0.5 / 201)),
        _init("half_z", np.uint8(0)),
        _init("one_q", np.uint8(250)), _init("one_s", np.float32(1.0 / 237)),
        _init("one_z", np.uint8(13)),
        _init("gamma_q", rng.integers(120, 256, (1, C, 1, 1)).astype(np.uint8)),
        _init("gamma_s", np.array([0.011, 0.007, 0.019, 0.004], np.float32)),
        _init("gamma_z", np.array([0, 9, 3, 0], np.uint8)),
        _init("beta_q", rng.integers(0, 256, (1, C, 1, 1)).astype(np.uint8)),
        _init("beta_s", np.array([0.013, 0.002, 0.009, 0.021], np.float32)),
        _init("beta_z", np.array([128, 40, 200, 77], np.uint8)),
    ]  # fmt: skip
    nodes = []
    grids = [(0.031, 128), (0.017, 64), (0.023, 30), (0.029, 100), (OUT_SCALE, 120)]
    for i, (s, z) in enumerate(grids):
        inits += [_init(f"s{i}", np.float32(s)), _init(f"z{i}", np.uint8(z))]

    def qdq(x: str, i: int) -> str:
        nodes.append(helper.make_node("QuantizeLinear", [x, f"s{i}", f"z{i}"], [f"{x}_q"]))
        nodes.append(helper.make_node("DequantizeLinear", [f"{x}_q", f"s{i}", f"z{i}"], [f"{x}_d"]))
        return f"{x}_d"

    def const(name: str, axis: int | None = None) -> str:
        kw = {} if axis is None else {"axis": axis}
        ins = [f"{name}_q", f"{name}_s", f"{name}_z"]
        nodes.append(helper.make_node("DequantizeLinear", ins, [f"{name}_d"], **kw))
        return f"{name}_d"

    h = qdq("x", 0)
    for i, (op, name, axis) in enumerate(
        [("Mul", "half", None), ("Add", "one", None), ("Mul", "gamma", 1), ("Add", "beta", 1)]
    ):
        out = f"t{i}"
        nodes.append(helper.make_node(op, [h, const(name, axis)], [out], name=f"{op}_{name}"))
        h = qdq(out, i + 1)
    nodes.append(helper.make_node("Identity", [h], ["y"]))
    graph = helper.make_graph(
        nodes, "constants",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", C, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", C, 5, 5])],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _constants(model: onnx.ModelProto) -> list[tuple]:
    """(codes, shape, scales, zero points, axis) of every DequantizeLinear of a constant."""
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    found = []
    for n in model.graph.node:
        if n.op_type != "DequantizeLinear" or n.input[0] not in consts:
            continue
        q, s, z = (consts[i] for i in n.input)
        axis = next((a.i for a in n.attribute if a.name == "axis"), None) if s.size > 1 else None
        found.append((q.tobytes(), q.shape, s.tobytes(), z.tobytes(), axis))
    return sorted(found)


def _ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), so, providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"x": x})[0]


def test_scalar_and_per_channel_constants_round_trip(tmp_path):
    model = _qdq_file()
    qmodel = qb.import_onnx(model)
    constants = [q for q in qmodel._all_quantizers() if isinstance(q, ConstantQuantizer)]
    assert sorted(q.axis is not None for q in constants) == [False, False, True, True]
    x = np.random.default_rng(0).standard_normal((3, C, 5, 5)).astype(np.float32) * 2
    with torch.no_grad():
        y = qmodel(torch.from_numpy(x)).numpy()
    reference = _ort(model, x)
    assert np.abs(y - reference).max() <= OUT_SCALE * (1 + 1e-3)
    out = tmp_path / "again.onnx"
    qb.export(qmodel, out, example_inputs=torch.from_numpy(x[:2]))
    again = onnx.load(str(out))
    assert _constants(again) == _constants(model)  # codes, scales, zero points, axes
    np.testing.assert_array_equal(_ort(again, x), reference)  # the same QDQ arithmetic


def test_learn_scales_leaves_constants_on_the_file_grid():
    """Constants never train nor learn their grid (``ConstantQuantizer.make_learnable``)."""
    qmodel = qb.import_onnx(_qdq_file(), learn_scales=True)
    constants = [q for q in qmodel._all_quantizers() if isinstance(q, ConstantQuantizer)]
    assert len(constants) == 4 and not any(q.learnable for q in constants)
