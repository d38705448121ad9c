"""``qb.to_engine(q, "openvino")`` runs the OpenVINO layout by default (``layout=``).

Before, the engine model compiled the canonical QDQ file (ONNX Runtime's layout) in OpenVINO,
whose Q/DQ pairs after each Add / Mul run there as stand-alone float FakeQuantize layers: the
PP-OCRv4 detector ran at 0.6x OpenVINO's own float speed, the OpenVINO layout (``qb.export(...,
target="openvino")``) at 1.2-1.6x (docs/openvino.md). A user choosing OpenVINO wants the latter;
``layout="onnxruntime"`` keeps ONNX Runtime's roundings, and a checkpoint keeps the choice.
"""

from __future__ import annotations

import warnings

import onnx
import pytest
import torch
from torch import nn

import quantbridge as qb

pytest.importorskip("openvino")


class _Block(nn.Module):
    """conv -> hard-swish -> conv + residual: Q/DQ pairs after Add / Mul in the canonical file,
    which the OpenVINO layout removes."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = nn.functional.hardswish(self.conv1(x))
        h = self.conv2(h) + h
        return self.head(h.mean((2, 3)))


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-VNNI advice; not what this test is about
        qmodel = qb.quantize(_Block().eval(), [x], progress=False)
    return qmodel, x


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.fixture(scope="module")
def ort(block):
    return qb.to_engine(block[0], "onnxruntime", threads=1)


def test_openvino_runs_the_openvino_layout_unless_asked_for_onnxruntimes(block, ort, tmp_path):
    qmodel, x = block
    canonical = ort.onnx_model  # qb.export's file (test_engine: bit-identical session outputs)
    assert ort.layout == "onnxruntime"
    file = qb.openvino_layout(canonical)  # = qb.export(..., target="openvino")
    fast = qb.to_engine(qmodel, "openvino", threads=1)
    assert fast.layout == "openvino" and "layout=openvino" in repr(fast)
    assert _ops(fast.onnx_model) == _ops(file)
    assert _ops(file).count("QuantizeLinear") < _ops(canonical).count("QuantizeLinear")
    keep = qb.to_engine(qmodel, "openvino", threads=1, layout="onnxruntime")
    assert keep.onnx_bytes() == ort.onnx_bytes()
    # the same model with fewer roundings: OpenVINO's outputs stay within quantization noise of
    # the QuantModel (logit range ~1; a handful of 8-bit steps of the ~0.01-wide output grid)
    ref = qmodel(x).detach()
    torch.testing.assert_close(fast(x), ref, atol=0.05, rtol=0)
    with qb.float_mode(fast):  # the float form has no Q/DQ: the same for every layout
        assert "QuantizeLinear" not in _ops(fast.onnx_model)
    qb.save(fast, tmp_path / "m.qb")
    loaded = qb.load(tmp_path / "m.qb")
    assert loaded.layout == "openvino" and loaded.onnx_bytes() == fast.onnx_bytes()  # what runs


def test_layout_of_a_file_and_its_errors(block, ort, tmp_path):
    qmodel, x = block
    canonical = ort.onnx_model
    ort.save_onnx(tmp_path / "ort.onnx")
    stored = qb.to_engine(tmp_path / "ort.onnx", "openvino")
    assert stored.layout is None and _ops(stored.onnx_model) == _ops(canonical)  # as stored
    laid = qb.to_engine(tmp_path / "ort.onnx", "openvino", layout="openvino")
    assert _ops(laid.onnx_model) == _ops(qb.openvino_layout(canonical))
    with pytest.raises(ValueError, match="layout='tensorrt' is not a known layout; use one of"):
        qb.to_engine(qmodel, "openvino", layout="tensorrt")
    with pytest.raises(ValueError, match="integer program lowers the canonical QDQ layout"):
        qb.to_engine(qmodel, "integer", layout="openvino")
    with pytest.raises(ValueError, match="a float _Block has none"):
        qb.to_engine(_Block().eval(), "openvino", example_inputs=x, layout="openvino")


class _NothingQuantized(nn.Module):
    def forward(self, x):
        return x.flip(1)


def test_a_quantmodel_with_nothing_quantized_runs_on_openvino():
    # openvino_layout refuses a graph without QuantizeLinear; the default layout must not
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nothing in _NothingQuantized is quantized"
        qmodel = qb.quantize(_NothingQuantized().eval(), [torch.randn(2, 4)], progress=False)
    x = torch.randn(2, 4)
    assert torch.equal(qb.to_engine(qmodel, "openvino", threads=1)(x), x.flip(1))
