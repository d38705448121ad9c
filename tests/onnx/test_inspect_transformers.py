"""``inspect`` counts the int8 matmuls ONNX Runtime runs in transformer blocks (issue 12, part 7).

``nn.Linear`` on 3-D input exports as ``DQ(int8 W) -> Transpose -> MatMul (+ Add bias)``. ONNX
Runtime moves the DequantizeLinear across the weight's Transpose and runs the MatMul as
QLinearMatMul (a QuantizeLinear follows) or MatMulIntegerToFloat (a float bias Add follows).
Before, ``inspect`` called these float (BERT: 4 of 16 MatMuls int8 where ORT ran 16). The check is
ONNX Runtime itself: the int8 matmul kernels in its optimized graph (``ORT_ENABLE_EXTENDED``, the
level that does the QDQ fusions) must equal inspect's int8 MatMul count, and the MatMuls it keeps
in float must equal inspect's float count. Tiny random-weight models from ``transformers``
configs (no download).
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

import quantbridge as qb
from quantbridge.onnx.inspector import inspect_model

_INT8_MATMULS = ("QLinearMatMul", "MatMulIntegerToFloat", "MatMulInteger")
_SMALL = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=64, max_position_embeddings=32, attn_implementation="eager")  # fmt: skip


class _Hidden(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).last_hidden_state


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "bert":
        return BertModel(BertConfig(**_SMALL)).eval()
    return LlamaModel(LlamaConfig(num_key_value_heads=2, **_SMALL)).eval()


def _ort_ops(path, tmp_path) -> collections.Counter:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "ort_optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return collections.Counter(
        n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node
    )


@pytest.mark.slow
@pytest.mark.parametrize(("name", "linears"), [("bert", 12), ("llama", 14)])
def test_int8_matmul_count_matches_onnx_runtime(name, linears, tmp_path):
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 100, (2, 8), generator=gen) for _ in range(3)]
    # 'native': the preset for this CPU's u8s8 kernels (the counts do not depend on it)
    qmodel = qb.quantize(_Hidden(_build(name)), ids, recipe="native", progress=False)
    path = tmp_path / f"{name}.onnx"
    qb.export(qmodel, path, example_inputs=ids[0])
    exported = collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    report = inspect_model(path)
    fused = _ort_ops(path, tmp_path)
    int8_kernels = sum(fused[op] for op in _INT8_MATMULS)
    # every projection (2 layers x 6 for BERT, x 7 for Llama) and q @ k^T; the softmax output
    # stays float (_ops.KEEP_FLOAT_OUTPUT_OPS, also through eager attention's dropout), so
    # probabilities @ v is a float MatMul in both
    assert int8_kernels == linears + 2
    assert report.int8_ops.get("MatMul", 0) == int8_kernels
    assert report.float_ops.get("MatMul", 0) == fused["MatMul"] == 2
    # the weights' Transposes are folded constants: neither int8 nor float work
    weight_transposes = exported["Transpose"] - report.int8_ops.get("Transpose", 0)
    assert weight_transposes >= linears and "Transpose" not in report.float_ops


def _linear_3d(bias: bool) -> onnx.ModelProto:
    """``nn.Linear`` on a [B, T, 8] input as exporters write it, with int8 weights."""
    w = np.random.default_rng(0).integers(-100, 100, (4, 8)).astype(np.int8)
    consts = {
        "x_scale": np.float32(0.05), "x_zp": np.uint8(128), "w": w, "w_scale": np.float32(0.01),
        "w_zp": np.int8(0), "b": np.arange(4, dtype=np.float32),
    }  # fmt: skip
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zp"], ["wd"]),
        helper.make_node("Transpose", ["wd"], ["wt"], perm=[1, 0], name="weight_t"),
        helper.make_node("MatMul", ["xd", "wt"], ["mm" if bias else "y"], name="linear"),
    ]
    if bias:
        nodes.append(helper.make_node("Add", ["mm", "b"], ["y"], name="bias"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 5, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("bias", [True, False])
def test_matmul_after_weight_transpose_is_int8(bias, tmp_path):
    model = _linear_3d(bias)
    path = tmp_path / "linear.onnx"
    onnx.save(model, str(path))
    report = inspect_model(path)
    fused = _ort_ops(path, tmp_path)
    assert fused["MatMulIntegerToFloat"] == 1 and fused["MatMul"] == 0  # ORT's verdict
    assert report.int8_ops == {"MatMul": 1}
    assert report.float_ops == ({"Add": 1} if bias else {})  # the float bias, as ORT runs it
