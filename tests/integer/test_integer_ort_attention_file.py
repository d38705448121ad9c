"""``qb.lower`` on what ONNX Runtime's ``quantize_static`` (QDQ, defaults) writes for a BERT
attention (toolfiles sweep, 2026-12-02; every HF BERT file ORT quantizes failed this way). Two
patterns, built here by ORT itself from a float graph made with onnx.helper:

* the token-type embedding: ``DQ(int8 table) -> Gather(constant indices) -> Q`` on the table's
  own grid: the Gather of an integer constant is an integer constant, and the QuantizeLinear of it
  was refused ("cannot quantize QConst");
* the additive attention mask: ``Where(keep, 0, finfo.min) -> Q -> DQ -> Add(scores)``. ORT
  quantizes the mask too (scale 1, zero point 0: the fill saturates to -128), so the file adds
  -128, not -inf, to the masked scores. It was refused ("cannot quantize MaskedScores").
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

import quantbridge as qb

logging.getLogger().setLevel(logging.ERROR)  # ORT's "consider pre-processing" advice
D = 16


def _float_file(path: str) -> None:
    rng = np.random.default_rng(0)
    c = numpy_helper.from_array
    inits = [c(rng.standard_normal((2, D)).astype(np.float32), "table"),
             c(np.zeros((1, 8), np.int64), "idx"), c(np.float32(0), "zero"),
             c(np.float32(np.finfo(np.float32).min), "fill"), c(np.array([1], np.int64), "ax1"),
             c((rng.standard_normal((D, D)) / 4).astype(np.float32), "wq")]  # fmt: skip
    n = helper.make_node
    nodes = [n("Gather", ["table", "idx"], ["emb"]), n("Add", ["x", "emb"], ["h"]),
             n("MatMul", ["h", "wq"], ["q"]), n("Transpose", ["h"], ["ht"], perm=[0, 2, 1]),
             n("MatMul", ["q", "ht"], ["scores"]), n("Cast", ["mask"], ["keep"], to=TensorProto.BOOL),
             n("Unsqueeze", ["keep", "ax1"], ["keep3"]), n("Where", ["keep3", "zero", "fill"], ["am"]),
             n("Add", ["scores", "am"], ["s2"]), n("Softmax", ["s2"], ["p"], axis=-1),
             n("MatMul", ["p", "h"], ["y"])]  # fmt: skip
    io = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "attention",
        [io("x", TensorProto.FLOAT, [2, 8, D]), io("mask", TensorProto.INT64, [2, 8])],
        [io("y", TensorProto.FLOAT, [2, 8, D])], inits,
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def _feeds(seed: int, padded: bool = True) -> dict[str, np.ndarray]:
    mask = np.ones((2, 8), np.int64)
    if padded:
        mask[1, 5:] = 0  # padding in the second sequence
    x = np.random.default_rng(seed).standard_normal((2, 8, D)).astype(np.float32)
    return {"x": x, "mask": mask}


class _Reader(CalibrationDataReader):
    def __init__(self, padded: bool):
        self._it = iter([_feeds(i, padded) for i in range(4)])

    def get_next(self):
        return next(self._it, None)


@pytest.mark.parametrize("padded_calibration", [False, True])
def test_ort_quantized_attention_with_embedding_and_mask_lowers(tmp_path, padded_calibration):
    """Calibrated without padding, ORT quantizes the mask to scale 1 (the program adds -128 to the
    masked scores, as ORT does); with padding, the mask and the masked scores to a step of ~1e36
    (every kept score is then the zero point: a uniform softmax over the kept keys, as in ORT).
    Program vs ORT running the file node by node, 4 inputs: at most 1 LSB of the output grid
    (four requantized layers; a float32 tie in ORT's requantization moves one code and the next
    layer carries it: ``test_integer_qoperator``), most codes exact. Measured: max 0."""
    src, path = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    _float_file(src)
    quantize_static(src, path, _Reader(padded_calibration))
    model = onnx.load(path)
    producer = {o: n for n in model.graph.node for o in n.output}
    quantized = {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    assert {"emb", "am"} <= quantized  # the two patterns under test are in ORT's file
    assert producer["emb"].op_type == "Gather" and producer["am"].op_type == "Where"
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    y_scale = float(inits["y_scale"])
    assert (float(inits["am_scale"]) > 1e30) == padded_calibration

    prog = qb.lower(path)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    diffs = []
    for seed in range(10, 14):
        feeds = _feeds(seed)
        (ours,) = prog.run(feeds).values()
        (expected,) = sess.run(None, feeds)
        diffs.append(np.abs(np.asarray(ours, np.float64) - expected) / y_scale)
    diffs = np.concatenate([d.ravel() for d in diffs])
    assert diffs.max() <= 1 + 1e-6
    assert (diffs < 0.5).mean() > 0.95


def _embedding_file(path: str) -> None:
    rng = np.random.default_rng(0)
    c = numpy_helper.from_array
    inits = [c(rng.standard_normal((20, D)).astype(np.float32), "table"),
             c((rng.standard_normal((D, D)) / 4).astype(np.float32), "w")]  # fmt: skip
    n = helper.make_node
    nodes = [n("Gather", ["table", "ids"], ["emb"]), n("Add", ["emb", "x"], ["h"]),
             n("MatMul", ["h", "w"], ["y"])]  # fmt: skip
    io = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "embedding",
        [io("ids", TensorProto.INT64, [2, 8]), io("x", TensorProto.FLOAT, [2, 8, D])],
        [io("y", TensorProto.FLOAT, [2, 8, D])], inits,
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def _embedding_feeds(seed: int) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    return {"ids": r.integers(0, 20, (2, 8)).astype(np.int64),
            "x": r.standard_normal((2, 8, D)).astype(np.float32)}  # fmt: skip


class _EmbeddingReader(CalibrationDataReader):
    def __init__(self):
        self._it = iter([_embedding_feeds(i) for i in range(4)])

    def get_next(self):
        return next(self._it, None)


def test_ort_qoperator_embedding_codes_lower(tmp_path):
    """ORT's QOperator file gathers the int8 table's codes by token id (no DequantizeLinear:
    ``Gather(int8 table, ids) -> QLinearAdd``); the lowering read the gathered codes as plain
    integers and refused their dequantization ("dequantizes IndexValue, not codes"). Program vs
    ORT on the file, at most 1 step of the output grid (the QLinearMatMul's output, dequantized:
    a float32 tie in ORT's QLinearAdd moves one code, ``test_integer_qoperator``).
    Measured: max 0."""
    src, path = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    _embedding_file(src)
    quantize_static(src, path, _EmbeddingReader(), quant_format=QuantFormat.QOperator)
    model = onnx.load(path)
    ops = {n.op_type: n for n in model.graph.node}
    assert "QLinearAdd" in ops and ops["Gather"].input[0].endswith("_quantized")
    (dq,) = [n for n in model.graph.node if n.output[0] == "y"]
    y_scale = float(numpy_helper.to_array(
        next(i for i in model.graph.initializer if i.name == dq.input[1])))  # fmt: skip

    prog = qb.lower(path)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    for seed in range(10, 13):
        feeds = _embedding_feeds(seed)
        (ours,) = prog.run(feeds).values()
        (expected,) = sess.run(None, feeds)
        assert np.abs(np.asarray(ours, np.float64) - expected).max() <= y_scale * (1 + 1e-6)
