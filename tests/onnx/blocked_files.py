"""Small group-wise (blocked) weight files for the tests: a MatMul quantized by ONNX Runtime's
``MatMulNBitsQuantizer`` (QDQ or MatMulNBits, symmetric or not) and blocked DequantizeLinear
weights written with ``onnx.helper`` (any type, axis, block size)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

K, N, M = 80, 24, 6  # K = 80: a partial last block of 16 with block 32


def float_matmul(k=K, n=N, seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.2
    b = rng.standard_normal(n).astype(np.float32) * 0.1
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])],
        "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, n])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def ort_quantized(fmt: str, symmetric: bool, block: int = 32) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quant_format = QuantFormat.QDQ if fmt == "qdq" else QuantFormat.QOperator
    q = MatMulNBitsQuantizer(float_matmul(), block_size=block, is_symmetric=symmetric,
                             quant_format=quant_format)  # fmt: skip
    q.process()
    return q.model.model


def run_ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def blocked_dq_model(onnx_type, lo, hi, axis, block, seed=3) -> tuple[onnx.ModelProto, dict]:
    """A MatMul whose [K, N] weight is a blocked DequantizeLinear along ``axis``."""
    rng = np.random.default_rng(seed)
    shape = (K, N)
    n_blocks = -(-shape[axis] // block)
    pshape = (n_blocks, N) if axis == 0 else (K, n_blocks)
    codes = rng.integers(lo, hi + 1, shape)
    zero = rng.integers(lo, hi + 1, pshape)
    scale = (rng.uniform(0.005, 0.05, pshape) * rng.choice([-1, 1], pshape)).astype(np.float32)
    nodes = [
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=axis,
                         block_size=block),
        helper.make_node("MatMul", ["x", "w"], ["y"]),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "blocked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", N])],
        [helper.make_tensor("wq", onnx_type, shape, codes.reshape(-1).tolist()),
         numpy_helper.from_array(scale, "ws"),
         helper.make_tensor("wz", onnx_type, pshape, zero.reshape(-1).tolist())],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    return model, {"codes": codes, "scale": scale, "zero": zero}
