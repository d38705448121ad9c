"""``qb.lower`` of ONNX Runtime's int4-weight QDQ file below opset 21 (toolfiles sweep,
2026-12-02): ``quantize_static(weight_type=QInt4)`` on an opset-13 model writes every
Q/DQ in the com.microsoft domain, which ONNX's shape inference does not know, so no shape after
them was inferred and a GlobalAveragePool was refused ("needs the input's rank")."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize_static

import quantbridge as qb

logging.getLogger().setLevel(logging.ERROR)  # ORT's "consider pre-processing" advice


def _x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 3, 8, 8)).astype(np.float32)


class _Reader(CalibrationDataReader):
    def __init__(self):
        self._it = iter([{"x": _x(i)} for i in range(4)])

    def get_next(self):
        return next(self._it, None)


def test_ort_int4_weights_below_opset_21_lower(tmp_path):
    """Program vs ORT running the file node by node: at most 1 LSB of the output grid (conv
    and pool requantized; a float32 tie moves a code). Measured: max 0."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) / 3).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["y"])]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 1, 1])], [w],
    )  # fmt: skip
    src, path = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), src)
    quantize_static(src, path, _Reader(), weight_type=QuantType.QInt4, per_channel=True)
    model = onnx.load(path)
    assert {n.domain for n in model.graph.node if n.op_type == "DequantizeLinear"} == {
        "com.microsoft"
    }  # the pattern under test
    (dq,) = [n for n in model.graph.node if n.output[0] == "y"]
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    y_scale = float(inits[dq.input[1]])

    prog = qb.lower(path)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    for seed in range(10, 13):
        (ours,) = prog.run({"x": _x(seed)}).values()
        (expected,) = sess.run(None, {"x": _x(seed)})
        assert np.abs(np.asarray(ours, np.float64) - expected).max() <= y_scale * (1 + 1e-6)
