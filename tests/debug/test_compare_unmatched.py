"""What ``compare`` lists as "not matched", and that a fold's requantize-free data movement is
no such tensor: the demo's files printed ``ort-qop: 1 tensors not matched (val_3)``, an internal
name saying nothing (it was the integer MaxPool's output, renamed by the fold)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb
from quantbridge.debug import CompareResult, render_html


def _qdq_maxpool_file(path):
    """x -> Q/DQ -> Conv -> Q/DQ -> MaxPool -> Q/DQ (same parameters: the form qb.export writes)
    -> Conv -> Q/DQ -> y."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.float32(0.05), "sx"),
        numpy_helper.from_array(np.float32(0.1), "sa"),
        numpy_helper.from_array(np.uint8(128), "z"),
        numpy_helper.from_array(rng.integers(-63, 64, (4, 3, 3, 3)).astype(np.int8), "w1"),
        numpy_helper.from_array(rng.integers(-63, 64, (4, 4, 1, 1)).astype(np.int8), "w2"),
        numpy_helper.from_array(np.float32(0.004), "sw"),
        numpy_helper.from_array(np.int8(0), "zw"),
    ]
    n = helper.make_node
    nodes = [
        n("QuantizeLinear", ["x", "sx", "z"], ["x_q"]),
        n("DequantizeLinear", ["x_q", "sx", "z"], ["x_dq"]),
        n("DequantizeLinear", ["w1", "sw", "zw"], ["w1_dq"]),
        n("DequantizeLinear", ["w2", "sw", "zw"], ["w2_dq"]),
        n("Conv", ["x_dq", "w1_dq"], ["c1"], "conv1", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        n("QuantizeLinear", ["c1", "sa", "z"], ["c1_q"]),
        n("DequantizeLinear", ["c1_q", "sa", "z"], ["c1_dq"]),
        n("MaxPool", ["c1_dq"], ["p"], "pool", kernel_shape=[2, 2], strides=[2, 2]),
        n("QuantizeLinear", ["p", "sa", "z"], ["p_q"]),
        n("DequantizeLinear", ["p_q", "sa", "z"], ["p_dq"]),
        n("Conv", ["p_dq", "w2_dq"], ["c2"], "conv2", kernel_shape=[1, 1]),
        n("QuantizeLinear", ["c2", "sa", "z"], ["y_q"]),
        n("DequantizeLinear", ["y_q", "sa", "z"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 3, 3])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 10
    onnx.save(model, path)


def test_folded_maxpool_output_is_paired_with_the_qdq_files(tmp_path):
    """ort-qop (the folded file in ONNX Runtime) against ort-ref (the QDQ file, node by node):
    every tensor paired, none unmatched; both run the same integer MaxPool on the same codes and
    QLinearConv requantizes as ORT's QDQ fusion, so within 1 LSB (a tie of the float reference)."""
    path = tmp_path / "m.onnx"
    _qdq_maxpool_file(path)
    x = np.random.default_rng(1).normal(0, 1, (2, 3, 6, 6)).astype(np.float32)
    data = qb.compare(str(path), inputs={"x": x}, engines=["ort-ref", "ort-qop"]).to_json()
    assert data["errors"] == {} and data["unmatched"] == {}
    pairs = {t["name"]: t["pairs"] for t in data["tensors"]}
    assert set(pairs) == {"x_q", "c1_q", "p_q", "y_q"}
    for name, p in pairs.items():
        assert len(p) == 1 and p[0]["b"] == "ort-qop" and p[0]["max_lsb"] <= 1.0 + 1e-3, name


def test_unmatched_tensors_are_named_with_their_op_and_layer():
    tensor = {"name": "val_3", "order": 3, "op": "MaxPool", "layer": "node_max_pool2d",
              "scale": 0.1, "zero_point": 0, "pairs": []}  # fmt: skip
    result = CompareResult({
        "schema": "quantbridge.compare/1", "models": [], "engines": ["ort-ref", "ort-qop"],
        "reference": "ort-ref", "errors": {}, "unmatched": {"ort-qop": ["val_3", "other"]},
        "tensors": [tensor], "first_divergence": None,
    })  # fmt: skip
    line = result.summary()[-1]
    assert line == "ort-qop: 2 tensors not matched (val_3 (MaxPool node_max_pool2d), other)"
    assert "val_3 (MaxPool node_max_pool2d)" in render_html(result.to_json(), None)


def test_a_divergence_on_a_float_tensor_is_summarised_without_lsb():
    """A graph's float output (CodeGen's final LayerNormalization: no scale, so no LSB) where two
    engines diverge (OpenVINO and ORT, 0.038 apart) is the first divergence; the summary names
    its largest difference. Before: ``TypeError: unsupported format string passed to
    NoneType.__format__`` from ``quantbridge compare`` after every engine had run."""
    tensor = {"name": "layer_norm_2", "order": 95, "op": "LayerNormalization",
              "layer": "node_layer_norm_2", "scale": None, "zero_point": None, "pairs": []}  # fmt: skip
    fd = {"name": "layer_norm_2", "order": 95, "layer": "node_layer_norm_2", "a": "ort-ref",
          "b": "openvino", "max_lsb": None, "max_abs": 0.0378}  # fmt: skip
    result = CompareResult({
        "schema": "quantbridge.compare/1", "models": [], "engines": ["ort-ref", "openvino"],
        "reference": "ort-ref", "errors": {}, "unmatched": {}, "tensors": [tensor],
        "first_divergence": fd,
    })  # fmt: skip
    line = next(x for x in result.summary() if x.startswith("first divergence"))
    assert line == (
        "first divergence: layer_norm_2 (#95, layer node_layer_norm_2): openvino is "
        "max |difference| 0.0378 from ort-ref (a float tensor): the first tensor the two "
        "engines compute differently"
    )


def test_a_file_and_its_import_are_paired_tensor_by_tensor(tmp_path):
    """``compare(file, qb.import_onnx(file))``: the imported QuantModel is exported (torch's
    names: ``val_3``...), and its quantizers are named after the file's tensors (the float input
    of each QuantizeLinear, or a QOperator op's output), which the export records. Pairing used
    names and QuantizeLinear inputs only, so every tensor but the output stayed unmatched and
    nothing was compared (import sweep, 2026-12-03: 65 of 66 on a MobileNetV2-style file). Now
    the export's record (each quantizer's tensors) pairs them all. The QDQ file's import computes
    its arithmetic: 0 LSB. The folded file's QLinearConv requantizes its int32 sum by
    ``sx * sw / sy`` in ORT's integer kernel while the import rounds the float32 sum: a .5 tie
    may land one code apart (the module docstring of ``passes``): at most 1 LSB."""
    path = tmp_path / "m.onnx"
    _qdq_maxpool_file(path)
    folded = tmp_path / "m_qop.onnx"
    onnx.save(qb.fold(str(path)), folded)
    x = np.random.default_rng(1).standard_normal((2, 3, 6, 6)).astype(np.float32)
    for src, tensors, lsb in (
        (path, {"x_q", "c1_q", "p_q", "y_q"}, 0),
        (folded, {"x_q", "c1_q", "y_q"}, 1),
    ):
        result = qb.compare(str(src), qb.import_onnx(str(src)), inputs={"x": x})
        paired = {t["name"] for t in result.tensors if t["pairs"]}
        assert paired == tensors and not result.unmatched, (src.name, paired, result.unmatched)
        assert all(p["max_lsb"] <= lsb for t in result.tensors for p in t["pairs"])
