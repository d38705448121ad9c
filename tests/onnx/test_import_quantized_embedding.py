"""ONNX Runtime's quantized embedding tables import (Case 5b of ``importer._quantized``).

``quantize_dynamic`` and ``quantize_static(QOperator)`` store an embedding table as int8 and
gather its rows as integers: ``Gather(int8 table, ids)`` read by a ``DequantizeLinear`` (a
Hugging Face BERT: the embeddings feed an Add), by ``MatMulInteger`` or by ``QLinearMatMul``
(the embedding feeds a Linear). Before the fix every one was refused ("operand ... is read as
integers but no QuantizeLinear or quantized op produces it"; BERT from ``quantize_dynamic``, the
regression sweep of 2026-12-02).
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from torch import nn

import quantbridge as qb
from quantbridge._platform import u8s8_saturates

logging.getLogger().setLevel(logging.ERROR)  # ORT's "consider pre-processing" advice
VOCAB, T = 50, 7


class _Embed(nn.Module):
    """An embedding feeding a Linear, or (``position=True``) an Add of position embeddings
    first, as BERT's embeddings do."""

    def __init__(self, position: bool | str):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.pos = nn.Parameter(torch.randn(T, 16)) if position is True else None
        self.fc = nn.Linear(16, 8)
        self.residual = position == "residual"  # the rows feed the Linear and an Add

    def forward(self, ids):
        e = self.emb(ids)
        if self.residual:
            return self.fc(e) + e[..., :8]
        return self.fc(e if self.pos is None else e + self.pos)


def _ids(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (2, T))


class _Reader(CalibrationDataReader):
    def __init__(self):
        self._it = iter([{"ids": _ids(i)} for i in range(4)])

    def get_next(self):
        return next(self._it, None)


def _files(tmp_path, position: bool | str, fmt: str) -> str:
    torch.manual_seed(0)
    src, dst = str(tmp_path / "f.onnx"), str(tmp_path / f"{fmt}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Embed(position).eval(), (torch.from_numpy(_ids(9)),), src,
                          dynamo=False, opset_version=17, input_names=["ids"],
                          dynamic_axes={"ids": {0: "b"}})  # fmt: skip
    if fmt == "dynamic":
        quantize_dynamic(src, dst, weight_type=QuantType.QInt8, reduce_range=True)
    else:
        # reduce_range (7-bit weights) where ORT's u8s8 kernels saturate pair sums (no VNNI), as
        # ORT's documentation advises for such CPUs: else ORT does not compute its own file
        quantize_static(
            src, dst, _Reader(), quant_format=QuantFormat.QOperator, reduce_range=u8s8_saturates()
        )
    return dst


@pytest.mark.parametrize(
    "position,fmt,reader",
    [(True, "dynamic", "DequantizeLinear"), (False, "dynamic", "MatMulInteger"),
     (False, "qoperator", "QLinearMatMul"), ("residual", "dynamic", "MatMulInteger")],
)  # fmt: skip
def test_gathered_integer_table_matches_ort(tmp_path, position, fmt, reader):
    """The import computes what ONNX Runtime computes on the file, and exports again. Dynamic:
    a float result, the import sums dequantized values in float32 where ORT rescales an exact
    int32 sum (as ``test_import_quantized.test_dynamic_matches_ort``: <= 1e-5 of the largest
    output; measured 1.3e-7). QOperator: the output is on the file's grid; ORT requantizes the
    int32 sum with a float multiplier, the import rounds the float32 sum: a tie may differ by one
    step (measured: 0)."""
    path = _files(tmp_path, position, fmt)
    model = onnx.load(path)
    (gather,) = [n for n in model.graph.node if n.op_type == "Gather"]
    if position == "residual":  # the DequantizeLinear reading the rows first, as ORT wrote a
        # MiniLM-style file: the import refused it ("operand ... must come from a
        # DynamicQuantizeLinear"; the import sweep of 2026-12-03); either order is topological
        nodes = list(model.graph.node)
        dq = next(
            n for n in nodes if n.op_type == "DequantizeLinear" and gather.output[0] in n.input
        )
        nodes.remove(dq)
        nodes.insert(nodes.index(gather) + 1, dq)
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        onnx.save(model, path)
    consts = {i.name: i.data_type for i in model.graph.initializer}
    integer = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
    assert consts[gather.input[0]] in integer  # the table is stored as integers
    readers = [n.op_type for n in model.graph.node if gather.output[0] in n.input]
    assert reader in readers
    if position == "residual":
        assert readers == ["DequantizeLinear", "MatMulInteger"]
    x = np.concatenate([_ids(10), _ids(11)])
    qmodel = qb.import_onnx(path)
    with torch.no_grad():
        y = qmodel(torch.from_numpy(x)).numpy()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    expected = sess.run(None, {"ids": x})[0]
    if fmt == "dynamic":
        assert np.abs(y - expected).max() <= 1e-5 * np.abs(expected).max()
    else:
        out = [n for n in model.graph.node if n.output[0] == model.graph.output[0].name][0]
        step = onnx.numpy_helper.to_array(
            next(i for i in model.graph.initializer if i.name == out.input[1])
        )
        assert np.abs(y - expected).max() <= 1.001 * float(step)
    again = tmp_path / "again.onnx"
    qb.export(qmodel, again, example_inputs=torch.from_numpy(x))
    sess = ort.InferenceSession(str(again), providers=["CPUExecutionProvider"])
    # re-exported: the same model in ORT, up to ORT's own float rounding
    np.testing.assert_allclose(
        sess.run(None, {"ids": x})[0], y, rtol=0, atol=1e-5 * np.abs(y).max()
    )
