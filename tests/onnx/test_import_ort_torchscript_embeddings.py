"""ONNX Runtime's QDQ file of a TorchScript-exported BERT-style embedding (toolfiles sweep,
2026-12-02; `torch.onnx.export(dynamo=False)`, as Hugging Face Optimum exports, then
``quantize_static``). The position embedding is ``Gather(DQ(table), Slice(position_ids, 0,
seq_len))`` followed by a QuantizeLinear on the table's grid: the import computes that Gather
on the host (its indices are a static slice of a constant), and the site after it refused the
numpy value ("quantbridge_import::site() Expected a value of type 'Tensor'")."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.quantization import CalibrationDataReader, quantize_static
from torch import nn

import quantbridge as qb

logging.getLogger().setLevel(logging.ERROR)  # ORT's "consider pre-processing" advice


class _Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(50, 16), nn.Embedding(32, 16)
        self.register_buffer("position_ids", torch.arange(32)[None])
        self.fc = nn.Linear(16, 8)

    def forward(self, ids):
        return self.fc(self.tok(ids) + self.pos(self.position_ids[:, : ids.shape[1]]))


def _ids(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50, (2, 8)).astype(np.int64)


class _Reader(CalibrationDataReader):
    def __init__(self):
        self._it = iter([{"ids": _ids(i)} for i in range(4)])

    def get_next(self):
        return next(self._it, None)


def _ort(path: str, ids: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"ids": ids})[0]


def _file(tmp_path) -> tuple[str, float]:
    torch.manual_seed(0)
    src, path = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Embeddings().eval(), (torch.from_numpy(_ids(9)),), src, dynamo=False,
                          opset_version=14, input_names=["ids"], output_names=["y"],
                          dynamic_axes={"ids": {0: "b"}})  # fmt: skip
    quantize_static(src, path, _Reader())
    model = onnx.load(path)
    producer = {o: n for n in model.graph.node for o in n.output}
    (gather,) = [n for n in model.graph.node if n.op_type == "Gather" and "pos" in n.input[0]]
    assert producer[gather.input[1]].op_type == "Slice"  # the pattern under test
    (out_dq,) = [n for n in model.graph.node if n.output[0] == "y"]
    scale = next(i for i in model.graph.initializer if i.name == out_dq.input[1])
    return path, float(onnx.numpy_helper.to_array(scale))


def test_torchscript_position_embedding_file_imports_and_trains(tmp_path):
    """torch(import) = ORT (node by node) within 1 LSB of the output grid (same float32 ops in
    another order: a code moves only on a tie; measured 0), and an SGD step moves the weights."""
    path, y_scale = _file(tmp_path)
    model = qb.import_onnx(path)
    ids = _ids(20)
    got = model(torch.from_numpy(ids)).detach().numpy()
    assert np.abs(got - _ort(path, ids)).max() <= y_scale * (1 + 1e-6)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    model.train()
    model(torch.from_numpy(ids)).pow(2).mean().backward()
    torch.optim.SGD(params, lr=0.1).step()
    assert any(not torch.equal(a, p) for a, p in zip(before, params, strict=True))
