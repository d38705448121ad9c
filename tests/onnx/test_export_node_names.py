"""Exported node names are the module paths of their ops (``onnx/exporter/_node_names``), unique,
and kept by ONNX Runtime's fused graph, ``fold`` and ``compare``; the names are all that change."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import quantbridge as qb
from quantbridge.cli import main
from quantbridge.onnx.exporter import _export
from quantbridge.zoo import resnet18_style


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    """(QuantModel, example, path of its QDQ file) of ResNet-18-style (width 8)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    qmodel = qb.quantize(resnet18_style(10, width=8).eval(), [x], progress=False)
    path = tmp_path_factory.mktemp("names") / "r18.onnx"
    qb.export(qmodel, path, x, progress=False)
    return qmodel, x, path


def _names(model: onnx.ModelProto) -> dict[str, str]:
    return {n.name: n.op_type for n in model.graph.node}


def test_resnet_nodes_are_named_after_their_modules(resnet):
    _, _, path = resnet
    model = onnx.load(path)
    names = [n.name for n in model.graph.node]
    assert len(set(names)) == len(names)  # unique
    expected = {
        "layer1.0.conv1": "Conv",  # a module's own op: its path
        "layer1.0.conv1.weight_dq": "DequantizeLinear",  # its weight's and bias's dequantization
        "layer1.0.conv1.bias_dq": "DequantizeLinear",
        "layer1.0.add": "Add",  # a functional op in a block: the block and the op
        "layer1.0.relu": "Relu",
        "layer1.0.relu_1": "Relu",  # the block's ReLU module called a second time
        "layer1.0.relu_1.output_q": "QuantizeLinear",  # the activation quantizer after it
        "layer1.0.relu_1.output_dq": "DequantizeLinear",
        "layer2.0.downsample.0": "Conv",
        "x_q": "QuantizeLinear",  # a graph input's quantizer
        "flatten": "Reshape",  # torch.flatten at the top level
        "fc": "Gemm",
    }
    assert {k: _names(model).get(k) for k in expected} == expected
    assert not [n for n in names if n.startswith("node_")]  # none of torch's own names left


def test_onnx_runtime_and_fold_keep_the_names(resnet, tmp_path):
    _, _, path = resnet
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "fused.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    fused = _names(onnx.load(tmp_path / "fused.onnx"))
    folded = _names(qb.fold(str(path)))
    for names in (fused, folded):
        assert names["layer1.0.conv1"] == "QLinearConv" and names["layer1.0.add"] == "QLinearAdd"


def test_only_the_names_change(resnet, tmp_path, monkeypatch):
    """The same file with torch's names (naming switched off): equal once node names are
    cleared (every op, attribute, initializer and value name), and ONNX Runtime computes
    bit-identical outputs from both."""
    qmodel, x, path = resnet
    monkeypatch.setattr(_export, "name_nodes", lambda *a: None)
    plain = qb.export(qmodel, tmp_path / "plain.onnx", x, progress=False)
    named = onnx.load(path)
    assert any(n.name == "node_conv2d_1" for n in plain.graph.node)  # the premise
    for m in (plain, named):
        for n in m.graph.node:
            n.name = ""
    assert named.SerializeToString() == plain.SerializeToString()
    inits = {i.name: numpy_helper.to_array(i) for i in plain.graph.initializer}
    for i in named.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(i), inits[i.name])
    feeds = {"x": x.numpy()}
    outputs = [
        ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, feeds)
        for p in (path, tmp_path / "plain.onnx")
    ]
    for a, b in zip(*outputs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_compare_shows_module_paths(resnet, tmp_path, capsys):
    _, x, path = resnet
    samples = tmp_path / "x.npz"
    np.savez(samples, x=x.numpy())
    assert main(["compare", str(path), "--inputs", str(samples), "--engines", "ort-ref,ort"]) == 0
    table = capsys.readouterr().out
    # tensors no quantizer record names: after their node (torch's: node_max_pool2d, node_linear)
    assert " maxpool " in table and " fc " in table and "node_" not in table


class SharedTwice(nn.Module):
    """One Conv2d module called twice (shared weights)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(torch.relu(self.conv(x)))


def test_a_module_called_twice_gets_unique_names(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8)
    qmodel = qb.quantize(SharedTwice().eval(), [x], progress=False)
    model = qb.export(qmodel, tmp_path / "twice.onnx", x, progress=False)
    names = [n.name for n in model.graph.node]
    assert len(set(names)) == len(names), names
    convs = [n.name for n in model.graph.node if n.op_type == "Conv"]
    assert convs == ["conv", "conv_1"]  # the second call takes _1, as torch numbers calls
    # one weight for both calls; a bias per call (its scale is each call's input scale x the
    # weight's), named after the call reading it
    assert {"conv.weight_dq", "conv.bias_dq", "conv_1.bias_dq", "relu.output_q"} <= set(names)


def test_an_imported_file_keeps_its_node_names(ppocr_det_int8):
    """PP-OCRv4's detector (import_onnx, quantize, export): its layers are named as in the
    file (``p2o.Conv.0``), not as the python identifiers of their modules (``p2o_Conv_0``)."""
    _, path = ppocr_det_int8
    model = onnx.load(path)
    names = _names(model)
    assert len(names) == len(model.graph.node)  # unique
    assert names["p2o.Conv.0"] == "Conv" and names["p2o.Conv.0.weight_dq"] == "DequantizeLinear"
    assert names["p2o.Conv.0.output_q"] == "QuantizeLinear"
    assert names["p2o.Add.2"] == "Add"  # an arithmetic node (an OnnxOp scope)
    assert not [n for n in names if n.startswith("node_") or "p2o_" in n]
