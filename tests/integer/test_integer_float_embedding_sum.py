"""``lower`` of NNCF's BERT files: the embedding sum ``word[ids] + token_type[0] + position`` and
the first LayerNormalization's input stay float (no QuantizeLinear before the LayerNorm's
output), the word and token-type tables int8 with per-row scales (axis 0, the gathered axis).
Was refused ("Gather ...: gathers from an integer constant", then "gather of a per-channel
constant", then "Add ...: operands must be quantized tensors"); now each float term is realized
on int16 codes of its bound (the program's rule for float results) and the LayerNorm output
agrees with ONNX Runtime. A float value with no bound still refuses, naming the tensor and
the fix."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantbridge.integer import lower
from quantbridge.integer.lowering import LoweringError

RNG = np.random.default_rng(0)
V, T, H = 12, 4, 16
IDS = RNG.integers(0, V, size=(2, T)).astype(np.int64)


def _per_row(name: str, table: np.ndarray) -> list:
    """int8 codes with one symmetric scale per row (NNCF's per-channel table on axis 0)."""
    scale = (np.abs(table).max(1) / 127).astype(np.float32)
    codes = np.clip(np.rint(table / scale[:, None]), -127, 127).astype(np.int8)
    return [numpy_helper.from_array(codes, name + "_q"),
            numpy_helper.from_array(scale, name + "_s"),
            numpy_helper.from_array(np.zeros(len(scale), np.int8), name + "_z")]  # fmt: skip


def _nncf_embeddings() -> onnx.ModelProto:
    word = RNG.normal(0, 0.02, (V, H)).astype(np.float32) * np.linspace(0.5, 2, V)[:, None]
    types = RNG.normal(0, 0.02, (2, H)).astype(np.float32)
    inits = [*_per_row("word", word.astype(np.float32)), *_per_row("types", types),
             numpy_helper.from_array(np.zeros((2, T), np.int64), "type_ids"),
             numpy_helper.from_array(RNG.normal(0, 0.02, (1, T, H)).astype(np.float32), "pos"),
             numpy_helper.from_array(RNG.normal(1, 0.1, H).astype(np.float32), "gamma"),
             numpy_helper.from_array(RNG.normal(0, 0.1, H).astype(np.float32), "beta"),
             numpy_helper.from_array(np.float32(4 / 127), "s_y"),
             numpy_helper.from_array(np.int8(0), "z_y")]  # fmt: skip
    nodes = [
        helper.make_node("DequantizeLinear", ["word_q", "word_s", "word_z"], ["word"], axis=0),
        helper.make_node("Gather", ["word", "ids"], ["we"], name="word_gather"),
        helper.make_node("DequantizeLinear", ["types_q", "types_s", "types_z"], ["types"], axis=0),
        helper.make_node("Gather", ["types", "type_ids"], ["te"], name="type_gather"),
        helper.make_node("Add", ["we", "te"], ["s1"], name="add_types"),
        helper.make_node("Add", ["s1", "pos"], ["s2"], name="add_positions"),
        helper.make_node("LayerNormalization", ["s2", "gamma", "beta"], ["ln"], epsilon=1e-12),
        helper.make_node("QuantizeLinear", ["ln", "s_y", "z_y"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "s_y", "z_y"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "nncf_embeddings", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, T])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, T, H])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def test_float_embedding_sum_lowers_as_onnx_runtime_computes_it():
    model = _nncf_embeddings()
    (got,) = lower(model).run({"ids": IDS}).values()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    (ref,) = ort.InferenceSession(model.SerializeToString(), so).run(None, {"ids": IDS})
    # each float term on int16 codes of its bound moves the sum by at most ~3 * bound / 65534,
    # ~1e-4 of a row's spread here: the LayerNorm's 8-bit output (step 0.031) agrees exactly
    # (measured: 0 steps on every element)
    assert np.abs(np.asarray(got, np.float64) - ref).max() / (4 / 127) <= 1e-4


def test_a_float_value_with_no_bound_is_named_with_the_fix():
    # x -> Q/DQ -> MatMul (no QuantizeLinear after it) -> Mul by a quantized tensor: the float
    # accumulator has no integer codes to multiply
    inits = [numpy_helper.from_array(v, k) for k, v in {
        "s": np.float32(0.05), "z": np.int8(0), "w": np.ones((H, H), np.int8)}.items()]  # fmt: skip
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wd"]),
        helper.make_node("MatMul", ["xd", "wd"], ["proj"], name="proj"),
        helper.make_node("Mul", ["proj", "xd"], ["m"], name="gate"),
        helper.make_node("QuantizeLinear", ["m", "s", "z"], ["mq"]),
        helper.make_node("DequantizeLinear", ["mq", "s", "z"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "float_gate", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, H])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(LoweringError) as e:
        lower(model)
    text = str(e.value)
    assert "Mul 'gate'" in text and "its input 'proj' is a float value" in text, text
    assert "no QuantizeLinear before this op" in text
    assert "add a QuantizeLinear -> DequantizeLinear pair on 'proj'" in text  # the fix
