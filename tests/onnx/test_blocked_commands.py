"""Group-wise (blocked) weights through ``inspect``, ``compare``, ``fold`` and ``lower``: the first
two show them (bits, block size), fold leaves them in QDQ form or refuses a MatMulNBits-only file,
lower refuses; the refusals name the node and the fix. Files are made with ``onnx.helper`` and
ONNX Runtime's ``MatMulNBitsQuantizer`` (``test_import_blocked``)."""

from __future__ import annotations

import numpy as np
import pytest
from blocked_files import K, blocked_dq_model, ort_quantized
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb
from quantbridge.integer import lower
from quantbridge.onnx import fold
from quantbridge.onnx.inspector import inspect_model


def _mixed_model():
    """uint8 activations (Q/DQ) into a MatMul whose int4 weight is blocked along K (block 16)."""
    model, file = blocked_dq_model(TensorProto.INT4, -8, 7, 0, 16)
    g = model.graph
    mm = next(n for n in g.node if n.op_type == "MatMul")
    mm.input[0] = "x_dq"
    g.node.insert(0, helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["x_q"]))
    g.node.insert(1, helper.make_node("DequantizeLinear", ["x_q", "xs", "xz"], ["x_dq"]))
    g.initializer.extend([
        numpy_helper.from_array(np.array(0.03, np.float32), "xs"),
        numpy_helper.from_array(np.array(128, np.uint8), "xz"),
    ])  # fmt: skip
    return model, file


def test_inspect_shows_bits_and_block_size():
    report = inspect_model(blocked_dq_model(TensorProto.UINT4, 0, 15, 0, 32)[0])
    (w,) = report.weights
    assert (w.dtype, w.bits, w.granularity) == ("uint4", 4, "per-block(axis=0, block_size=32)")
    nbits = inspect_model(ort_quantized("nbits", True))
    (w,) = nbits.weights
    assert (w.dtype, w.bits, w.shape) == ("uint4", 4, (K, 24))
    assert w.granularity == "per-block(axis=0, block_size=32, zero point 8)"
    assert nbits.form == "weight-only (MatMulNBits)"
    assert "uint4 4-bit per-block(axis=0, block_size=32, zero point 8)" in nbits.format()


@pytest.mark.parametrize("fmt", ["qdq", "nbits"])
def test_compare_weight_only_files_compares_outputs_and_lists_the_weights(fmt):
    model = ort_quantized(fmt, False)
    x = np.random.default_rng(2).standard_normal((2, 3, K)).astype(np.float32)
    result = qb.compare(model, inputs={"x": x}, engines=["ort-ref", "torch-quant"])
    (tensor,) = result.tensors  # the graph output: no activation is quantized
    (pair,) = tensor["pairs"]
    # the file's exact weights: what is left is float32 summation order (torch's matmul splits K
    # differently with 2 threads than with 1: 'rounding' then, 7e-7 measured on outputs ~1)
    assert pair["b"] == "torch-quant" and pair["class"] in ("exact", "rounding")
    assert pair["max_abs"] <= 1e-5 and (pair["sqnr_db"] is None or pair["sqnr_db"] > 100)
    (line,) = result.to_json()["group_wise_weights"]
    assert "4-bit" in line and "block_size=32" in line
    assert any(s.startswith("group-wise weights (1)") for s in result.summary())


def test_fold_keeps_blocked_weights_in_qdq_form_and_refuses_matmulnbits(tmp_path):
    model, _ = _mixed_model()
    folded = fold(model)
    ops = [n.op_type for n in folded.graph.node]
    assert "MatMul" in ops and "QLinearMatMul" not in ops  # no integer op takes blocks
    nbits = ort_quantized("nbits", True)
    with pytest.raises(ValueError, match="MatMulNBits .* group-wise .* nothing to fold"):
        fold(nbits)


def test_lower_refuses_naming_the_node():
    model, _ = _mixed_model()
    with pytest.raises(ValueError, match="DequantizeLinear .* holds group-wise weights .* "
                       "per-channel weights"):  # fmt: skip
        lower(model)
    with pytest.raises(ValueError, match="MatMulNBits '.*' holds group-wise weights"):
        lower(ort_quantized("nbits", False))


def test_mixed_file_imports_activation_grid_and_blocked_weight():
    import onnxruntime as ort
    import torch

    model, file = _mixed_model()
    qm = qb.import_onnx(model)
    kinds = sorted(type(q).__name__ for q in qm.quantizers().values())
    assert kinds == ["BlockWeightQuantizer", "Quantizer"]
    x = np.random.default_rng(8).standard_normal((4, K)).astype(np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ref = sess.run(None, {"x": x})[0]
    with torch.no_grad():
        y = qm(torch.from_numpy(x)).numpy()
    # inputs on the uint8 grid (exact in both), weights exact: only float32 summation order
    w = qb.numerics.dequantize(file["codes"], file["scale"], file["zero"], 0, 16)
    xq = np.clip(np.round(x / np.float32(0.03)) + 128, 0, 255) - 128
    bound = 2 * K * 2.0**-24 / (1 - K * 2.0**-24) * (np.abs(xq * 0.03) @ np.abs(w))
    assert np.all(np.abs(y - ref) <= bound + 2.0**-24 * np.abs(ref))


def _transposed_weight_graph(second_reader: bool):
    rng = np.random.default_rng(9)
    codes = rng.integers(-8, 8, (6, 10))  # [N, K], blocks of 4 along K (axis 1)
    scale = rng.uniform(0.1, 1.0, (6, 3)).astype(np.float32)
    nodes = [
        helper.make_node("DequantizeLinear", ["q", "s"], ["w"], axis=1, block_size=4),
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6])]
    if second_reader:
        nodes.append(helper.make_node("Identity", ["w"], ["w_out"]))
        outputs.append(helper.make_tensor_value_info("w_out", TensorProto.FLOAT, [6, 10]))
    graph = helper.make_graph(
        nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 10])], outputs,
        [helper.make_tensor("q", TensorProto.INT8, codes.shape, codes.reshape(-1).tolist()),
         numpy_helper.from_array(scale, "s")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_blocked_layout_pass_case_1_and_not_applied():
    from onnx.reference import ReferenceEvaluator

    from quantbridge.onnx.exporter._blocked_layout import untranspose_blocked_weights

    x = np.random.default_rng(10).standard_normal((2, 10)).astype(np.float32)
    model = _transposed_weight_graph(second_reader=False)
    (before,) = ReferenceEvaluator(model).run(None, {"x": x})
    assert untranspose_blocked_weights(model) == 1  # Case 1
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "MatMul"]
    (after,) = ReferenceEvaluator(model).run(None, {"x": x})
    np.testing.assert_array_equal(after, before)  # a permutation of exact products
    kept = _transposed_weight_graph(second_reader=True)
    assert untranspose_blocked_weights(kept) == 0  # the DQ has another reader: not applied
