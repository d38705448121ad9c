"""The export writes one Q/DQ pair where a second one on the same grid rounds nothing
(``onnx/exporter/_requantize``): ``DQ(s, z) -> Add(0) -> Q(s, z)``, the untrained ViT's
``cat([cls, patches]) + position_embeddings`` that OpenVINO 2026.4 cannot compile
(``passes/_openvino.openvino_crash_site``). Checked: the outputs are bit-identical in ONNX
Runtime (node by node and optimized), and OpenVINO compiles the new file (in a child process:
a regression would crash the child, not the test run)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import quantbridge as qb
from quantbridge.onnx.exporter import _export
from quantbridge.onnx.exporter._merged_calls import CALLS_KEY
from quantbridge.onnx.exporter._requantize import drop_identity_requantize
from quantbridge.onnx.passes._openvino import openvino_crash_site


def _file(op="Add", value=0.0, const_shape=(1, 1, 8), scale2=0.0086, x_shape=("batch", 4, 8)):
    """x -> Concat(x, x) -> Q -> DQ [-> op(const)] -> Q -> DQ -> Relu -> y."""
    inits = [
        numpy_helper.from_array(np.array(0.0086, np.float32), "s"),
        numpy_helper.from_array(np.array(scale2, np.float32), "s2"),
        numpy_helper.from_array(np.array(127, np.uint8), "z"),
        numpy_helper.from_array(np.full(const_shape, value, np.float32), "c"),
    ]
    nodes = [
        helper.make_node("Concat", ["x", "x"], ["cat"], axis=1, name="the_cat"),
        helper.make_node("QuantizeLinear", ["cat", "s", "z"], ["q1"]),
        helper.make_node("DequantizeLinear", ["q1", "s", "z"], ["d1"]),
    ]
    last = "d1"
    if op is not None:
        nodes.append(helper.make_node(op, ["d1", "c"], ["between"]))
        last = "between"
    nodes += [
        helper.make_node("QuantizeLinear", [last, "s2", "z"], ["q2"]),
        helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["d2"]),
        helper.make_node("Relu", ["d2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "requantize",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def _run(model, x, optimized: bool):
    so = ort.SessionOptions()
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), so, ["CPUExecutionProvider"])
    return session.run(None, {"x": x})


@pytest.mark.parametrize(("op", "value"), [("Add", 0.0), ("Sub", 0.0), ("Mul", 1.0), (None, 0)])
def test_the_second_pair_goes_and_every_output_bit_stays(op, value):
    before = _file(op, value)
    after = onnx.ModelProto()
    after.CopyFrom(before)
    assert drop_identity_requantize(after) == 1
    kinds = [n.op_type for n in after.graph.node]
    assert kinds == ["Concat", "QuantizeLinear", "DequantizeLinear", "Relu"]
    assert openvino_crash_site(before) == "the_cat"
    assert openvino_crash_site(after) is None
    if op is not None:  # the constant only the identity op read goes with it
        assert "c" not in {i.name for i in after.graph.initializer}
    # values from the grid's whole range and beyond (saturating codes), ties at half steps
    rng = np.random.default_rng(0)
    x = (rng.normal(0, 0.6, (3, 4, 8)) + 0.0043 * rng.integers(-1, 2, (3, 4, 8))).astype(np.float32)
    x[0, 0, :4] = [10.0, -10.0, 0.0043, -0.0129]
    for optimized in (False, True):
        (a,), (b,) = _run(before, x, optimized), _run(after, x, optimized)
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("an add of 0.5", {"value": 0.5}),
        ("another scale", {"scale2": 0.0087}),
        (
            "zeros that broadcast the tensor larger",
            {"const_shape": (1, 8, 8), "x_shape": (2, 1, 8)},
        ),
        ("zeros against an unknown dimension", {"const_shape": (1, 8, 8), "x_shape": (2, "n", 8)}),
        ("a Div with the constant first", {"op": "Div", "value": 1.0}),
    ],
)
def test_not_applied(case, kwargs):
    model = _file(**kwargs)
    if kwargs.get("op") == "Div":  # 1 / x is no identity
        div = next(n for n in model.graph.node if n.op_type == "Div")
        div.input[:] = ["c", "d1"]
    count = len(model.graph.node)
    assert drop_identity_requantize(model) == 0, case
    assert len(model.graph.node) == count


def test_a_second_pair_that_is_a_graph_output_stays():
    model = _file()
    model.graph.output.append(helper.make_tensor_value_info("q2", TensorProto.UINT8, None))
    assert drop_identity_requantize(model) == 0


class _TinyViT(nn.Module):
    """The ViT embedding an untrained HF DeiT / AST / YOLOS exports: ``cat([cls, patches]) +
    position_embeddings`` with all-zero position embeddings."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 16, 4, 4)
        self.cls = nn.Parameter(torch.randn(1, 1, 16) * 0.02)
        self.pos = nn.Parameter(torch.zeros(1, 17, 16))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        p = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), p], 1) + self.pos
        return self.head(self.norm(h)[:, 0])


@pytest.mark.slow  # two exports and a quantize: 1.5 s at load ~4, 9 s at load 18 (torch.export)
def test_export_of_a_zero_position_embedding(monkeypatch):
    torch.manual_seed(0)
    calib = [torch.randn(2, 3, 16, 16) for _ in range(2)]
    q = qb.quantize(_TinyViT().eval(), calib)
    after = _export.to_onnx(q, calib[0])
    with monkeypatch.context() as m:
        m.setattr(_export, "drop_identity_requantize", lambda model: 0)
        before = _export.to_onnx(q, calib[0])
    assert openvino_crash_site(before) == "cat"  # named after its op (export names nodes)
    assert openvino_crash_site(after) is None
    assert "Add" not in {n.op_type for n in after.graph.node}
    x = calib[1].numpy()
    for optimized in (False, True):
        (a,), (b,) = _run(before, x, optimized), _run(after, x, optimized)
        assert a.tobytes() == b.tobytes()
    # the add's quantizer call now names the concat's QuantizeLinear, which holds its codes
    record = json.loads(
        next(p.value for p in after.metadata_props if p.key == "quantbridge.quantizers")
    )
    q_outputs = {n.output[0] for n in after.graph.node if n.op_type == "QuantizeLinear"}
    sites = [s for v in record.values() for s in v.get("sites", ()) if s]  # "": a call removed
    assert sites and set(sites) <= q_outputs
    assert all(p.key != CALLS_KEY for p in after.metadata_props)


def test_openvino_compiles_the_new_file(tmp_path):
    pytest.importorskip("openvino")
    model = _file()
    drop_identity_requantize(model)
    path = tmp_path / "one_pair.onnx"
    onnx.save(model, path)
    code = f"import openvino as ov; ov.Core().compile_model({str(path)!r}, 'CPU')"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
