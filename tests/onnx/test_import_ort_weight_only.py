"""ONNX Runtime's weight-only LLM formats beyond ``MatMulNBits`` itself (``test_import_blocked``
has that): the block-quantized embedding table ``GatherBlockQuantized`` that
``MatMulNBitsQuantizer(op_types_to_quantize=(..., "Gather"))`` writes, and ``MatMulNBits`` with
``accuracy_level=4`` (ORT quantizes the activation to int8; the import warns).

Files are made in the test with ONNX Runtime's own quantizer. Tolerances: the imported table and
weight are the file's dequantized values (float32, exact), activations are float, so the import
differs from ORT (graph optimizations off) only by float32 summation order in the one matmul of
length ``K = 40``: below ``2 K u sum|x||w|`` (about 5e-6 * 17 here); we allow 1e-5 relative to the
output's largest value.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb
from quantbridge.onnx.importer._nbits import AccuracyLevelWarning

V, D, N, T, BLOCK = 20, 40, 8, 5, 16  # D = 40: a partial last block of 8


def _embedding_model() -> onnx.ModelProto:
    """Gather -> MatMul; row 0 of the table is all zeros (a padding embedding, as BERT's): ONNX
    Runtime's quantizer gives its blocks scale 0, which the import read as an invalid grid."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((V, D)).astype(np.float32)
    table[0] = 0
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], axis=0),
             helper.make_node("MatMul", ["e", "w"], ["y"])]  # fmt: skip
    graph = helper.make_graph(
        nodes, "embed", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", T])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", T, N])],
        [numpy_helper.from_array(table, "table"),
         numpy_helper.from_array(rng.standard_normal((D, N)).astype(np.float32) * 0.2, "w")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _ort_quantize(model: onnx.ModelProto, **kw) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    q = MatMulNBitsQuantizer(model, block_size=BLOCK, **kw)
    q.process()
    return q.model.model


def _run_ort(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def test_gather_block_quantized_imports_like_onnxruntime_and_is_refused_by_name(tmp_path):
    model = _ort_quantize(_embedding_model(), op_types_to_quantize=("MatMul", "Gather"))
    ops = {n.op_type for n in model.graph.node}
    assert {"GatherBlockQuantized", "MatMulNBits"} <= ops
    ids = np.random.default_rng(1).integers(0, V, (2, T))
    ids[0, 0] = 0  # the padding row
    ref = _run_ort(model, {"ids": ids})
    qm = qb.import_onnx(model)  # was: "unsupported ops com.microsoft.GatherBlockQuantized"
    qm.eval()
    y = qm(torch.from_numpy(ids))
    assert np.abs(y.detach().numpy() - ref).max() <= 1e-5 * np.abs(ref).max()
    # one SGD step moves the MatMulNBits weight (its block quantizer passes the gradient)
    qm.train()
    params = [p for p in qm.parameters() if p.requires_grad]
    qm(torch.from_numpy(ids)).pow(2).mean().backward()
    assert params and all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    # fold / lower name the op (they said "a float model" when it was the only quantized op)
    path = tmp_path / "gbq.onnx"
    only_gather = _ort_quantize(_embedding_model(), op_types_to_quantize=("Gather",))
    onnx.save(only_gather, path)
    with pytest.raises(ValueError, match="GatherBlockQuantized.*group-wise weights"):
        qb.fold(path, tmp_path / "folded.onnx")
    with pytest.raises(ValueError, match="GatherBlockQuantized.*group-wise weights"):
        qb.lower(path, input_shapes={"ids": (2, T)})


def test_accuracy_level_4_is_named_with_what_ort_computes():
    """ORT's accuracy_level=4 kernel quantizes A per block of BLOCK along K to int8 (symmetric,
    s = max|a| / 127): that emulation matches ORT within float rounding (measured 1e-6) where the
    float product differs by ~0.02; the import computes the float product and warns."""
    rng = np.random.default_rng(2)
    model = _ort_quantize(_embedding_model(), op_types_to_quantize=("MatMul",), accuracy_level=4)
    nbits = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    e_model = onnx.ModelProto()
    e_model.CopyFrom(model)
    e_model.graph.output[0].CopyFrom(helper.make_tensor_value_info("e", TensorProto.FLOAT, None))
    ids = rng.integers(0, V, (2, T))
    a = _run_ort(e_model, {"ids": ids})  # the MatMulNBits input
    level4 = _run_ort(model, {"ids": ids})
    blocks = np.zeros((2, T, 3 * BLOCK), np.float32)
    blocks[..., :D] = a
    blocks = blocks.reshape(2, T, 3, BLOCK)
    s = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    a_int8 = (np.rint(blocks / s) * s).reshape(2, T, -1)[..., :D].astype(np.float32)
    with pytest.warns(AccuracyLevelWarning, match=f"{nbits.name}.*accuracy_level=4"):
        qm = qb.import_onnx(model)
    qm.eval()
    # the imported model's MatMul on ORT's int8-rounded A reproduces ORT's accuracy_level 4 ...
    w = next(p for p in qm.parameters())  # nn.Linear weight [N, D], the file's values
    emulated = a_int8 @ w.detach().numpy().T
    assert np.abs(emulated - level4).max() <= 1e-5 * np.abs(level4).max()
    # ... and on float A it computes the op's definition (accuracy_level 0 in ORT)
    nbits.attribute.remove(next(x for x in nbits.attribute if x.name == "accuracy_level"))
    level0 = _run_ort(model, {"ids": ids})
    y = qm(torch.from_numpy(ids)).detach().numpy()
    assert np.abs(y - level0).max() <= 1e-5 * np.abs(level0).max()
    assert np.abs(level4 - level0).max() > 1e-3 * np.abs(level0).max()  # the warned difference


def _nncf_int8_weight_only() -> onnx.ModelProto:
    """The layout of NNCF's ``compress_weights(mode=INT8_ASYM)`` on ONNX (measured on a GPT-2):
    the embedding table per row (``axis=0``) read by Gather, the MatMul weight per output column
    with ``axis=-1``, uint8 codes and zero points; no QuantizeLinear anywhere."""
    rng = np.random.default_rng(4)
    table_codes = rng.integers(0, 256, (V, D)).astype(np.uint8)
    w_codes = rng.integers(0, 256, (D, N)).astype(np.uint8)
    inits = [
        numpy_helper.from_array(table_codes, "table_q"),
        numpy_helper.from_array(rng.uniform(0.005, 0.02, V).astype(np.float32), "table_s"),
        numpy_helper.from_array(rng.integers(100, 156, V).astype(np.uint8), "table_z"),
        numpy_helper.from_array(w_codes, "w_q"),
        numpy_helper.from_array(rng.uniform(0.002, 0.01, N).astype(np.float32), "w_s"),
        numpy_helper.from_array(rng.integers(100, 156, N).astype(np.uint8), "w_z"),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["table_q", "table_s", "table_z"], ["table"], axis=0),
        helper.make_node("Gather", ["table", "ids"], ["e"], axis=0),
        helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"], axis=-1),
        helper.make_node("MatMul", ["e", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "nncf_int8", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", T])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", T, N])], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_int8_weight_only_file_is_compared_and_refused_by_lower_by_name(tmp_path):
    """compare called NNCF's INT8 weight-only file "a float model" and lower said "its input is
    an unquantized float result"; now compare compares the outputs and lower names the weight."""
    model = _nncf_int8_weight_only()
    path = tmp_path / "w8.onnx"
    onnx.save(model, path)
    ids = np.random.default_rng(5).integers(0, V, (2, T))
    ref = _run_ort(model, {"ids": ids})
    qm = qb.import_onnx(path)
    qm.eval()
    y = qm(torch.from_numpy(ids)).detach().numpy()
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    with pytest.raises(ValueError, match="DequantizeLinear.*integer weight.*no activation"):
        qb.lower(path, input_shapes={"ids": (2, T)})
    result = qb.compare(path, inputs={"ids": ids}, engines=["ort-ref", "torch-quant"])
    (row,) = result.tensors
    (pair,) = row["pairs"]
    assert pair["max_abs"] <= 1e-5 * np.abs(ref).max()


def test_signed_per_channel_scales_are_refused_naming_nncf_int8_sym():
    """NNCF's INT8_SYM writes negative per-row scales (ORT runs them); the import refuses them by
    tensor, now saying where they come from and which mode to use instead."""
    model = _nncf_int8_weight_only()
    inits = {i.name: i for i in model.graph.initializer}
    scale = numpy_helper.to_array(inits["table_s"]) * np.float32(-1)
    inits["table_s"].CopyFrom(numpy_helper.from_array(scale, "table_s"))
    with pytest.raises(ValueError, match="'table_q'.*not positive.*NNCF.*INT8_ASYM"):
        qb.import_onnx(model)


def test_compare_notes_where_onnxruntime_rounds_the_activation_to_int8():
    """compare's text says where ORT quantizes a weight-only product's input (measured on a
    GPT-2: 'ort' vs 'ort-ref' SQNR 47.7 dB, reported as 'rounding' with no note before)."""
    from blocked_files import ort_quantized

    from quantbridge.onnx._weight_only import int8_activation_products

    level4 = _ort_quantize(_embedding_model(), op_types_to_quantize=("MatMul",), accuracy_level=4)
    (line,) = int8_activation_products(level4)
    assert "accuracy_level=4" in line and "MatMulNBits" in line
    (line,) = int8_activation_products(ort_quantized("qdq", symmetric=True))
    assert "DequantizeLinear" in line and "fuses it into MatMulNBits" in line
    assert int8_activation_products(_embedding_model()) == []
