"""Imported float ONNX models keep the dynamic dimensions their file declares (issue 12, part 5).

A class-token ViT exported with a dynamic batch by both of torch's exporters: dynamo writes
``Expand(cls, Concat(Shape(x)[0:1], [1], [1]))``; the TorchScript exporter writes
``expand(B, -1, -1)`` as ``ConstantOfShape -> Mul -> Equal -> Where -> Expand``. Both must import,
quantize and export to a file that ONNX Runtime runs at batch 1 and batch 3 (before the fix the
Expand was folded to the example batch: a ``[2, 1, D]`` constant, and the export failed at any
other batch). Where a dimension cannot stay symbolic, the trace warns naming the ONNX node.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import quantbridge as qb
from quantbridge.onnx.importer._symbolic import DynamicDimensionWarning


class _ClassTokenViT(nn.Module):
    """The ViT pattern: patch conv, a class token expanded to the batch, position embedding, one
    pre-norm MLP block, and the head on the class token."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 8, 8)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 17, d))
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, d)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        b = x.shape[0]
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(b, -1, -1), t], 1) + self.pos
        t = t + self.fc1(self.norm(t)).relu()
        return self.head(t[:, 0])


def _export_float(tmp_path, dynamo: bool) -> str:
    torch.manual_seed(0)
    model = _ClassTokenViT().eval()
    path = str(tmp_path / f"vit_{'dynamo' if dynamo else 'legacy'}.onnx")
    x = torch.randn(2, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        if dynamo:
            spec = {"x": {0: torch.export.Dim("batch")}}
            torch.onnx.export(model, (x,), path, dynamo=True, dynamic_shapes=spec, opset_version=18)
        else:
            torch.onnx.export(model, (x,), path, dynamo=False, opset_version=17,
                              input_names=["x"], dynamic_axes={"x": {0: "batch"}})  # fmt: skip
    return path, model


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_class_token_vit_keeps_dynamic_batch(tmp_path, dynamo):
    path, model = _export_float(tmp_path, dynamo)
    ops = [n.op_type for n in onnx.load(path).graph.node]
    assert "Expand" in ops and ("Where" in ops) == (not dynamo)  # the two exporters' patterns
    with warnings.catch_warnings():
        warnings.simplefilter("error", DynamicDimensionWarning)  # the import-time check: silent
        imported = qb.import_onnx(path)
    assert imported.dynamic_dims == {"x": {0: "batch"}}
    rng = torch.Generator().manual_seed(1)
    calib = [torch.randn(2, 3, 32, 32, generator=rng) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DynamicDimensionWarning)  # nothing may be specialised
        qmodel = qb.quantize(imported, calib, recipe="native")
    out = str(tmp_path / "vit.int8.onnx")
    qb.export(qmodel, out, example_inputs=calib[0])
    exported = onnx.load(out)
    assert exported.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # declared dynamic
    # no initializer holds the class token expanded to the example batch
    assert not any(list(i.dims) == [2, 1, 32] for i in exported.graph.initializer)
    # reference: ORT node by node (graph optimizations off) computes the file's QDQ arithmetic
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(out, options, providers=["CPUExecutionProvider"])
    for batch in (1, 3):
        x = torch.randn(batch, 3, 32, 32, generator=rng)
        with torch.no_grad():
            # the float import is the model, exactly (same float32 ops)
            torch.testing.assert_close(imported(x), model(x), rtol=1e-5, atol=1e-5)
            expected = qmodel(x).numpy()
        got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        assert got.shape == (batch, 10)
        # same codes on both sides; the float head differs by float32 summation order only
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _shape_switch_model() -> onnx.ModelProto:
    """``Reshape(x, Where(Shape(x)[0] == 2, [1, -1], [-1, 8]))``: a shape that depends on whether
    the batch equals 2, so tracing at batch 2 can only pin the batch."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["b"], name="batch_of_x", axis=0),
        helper.make_node("Equal", ["b", "two"], ["is_two"], name="batch_is_two"),
        helper.make_node("Where", ["is_two", "flat", "rows"], ["target"], name="pick_shape"),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
    ]
    consts = {
        "zero": np.array(0, np.int64),
        "two": np.array(2, np.int64),
        "flat": np.array([1, -1], np.int64),
        "rows": np.array([-1, 8], np.int64),
    }
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(v, k) for k, v in consts.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_import_names_the_specialised_dimension():
    """The warning comes from ``import_onnx`` itself (a fake-tensor run), before any quantize;
    ``example_inputs`` sets the size tried."""
    with pytest.warns(
        DynamicDimensionWarning,
        match=r"'batch_is_two'.*Equal.*dimension 0 of input 'x'.*'batch'.*to 2",
    ):  # noqa: E501
        qb.import_onnx(_shape_switch_model())
    with warnings.catch_warnings():
        warnings.simplefilter("error", DynamicDimensionWarning)
        # at batch 5 the node only learns "batch != 2": the dimension stays a symbol
        qb.import_onnx(_shape_switch_model(), example_inputs=torch.ones(5, 8))
        module = qb.import_onnx(_shape_switch_model(), check_dynamic=False)  # opt-out: silent
    assert module(torch.ones(3, 8)).shape == (3, 8)


def test_specialised_dimension_is_named():
    module = qb.import_onnx(_shape_switch_model(), check_dynamic=False)
    with torch.no_grad():  # eager: both branches right
        assert module(torch.ones(2, 8)).shape == (1, 16)
        assert module(torch.ones(3, 8)).shape == (3, 8)
    spec = {"x": {0: torch.export.Dim.AUTO}}
    with pytest.warns(DynamicDimensionWarning, match=r"dimension 0 of input 'x'.*'batch'.*to 2"):
        torch.export.export(module, (torch.ones(2, 8),), dynamic_shapes=spec, strict=False)


def test_scatter_nd_reduction_refused_with_supported_list():
    node = helper.make_node("ScatterND", ["x", "i", "u"], ["y"], name="mask", reduction="mul")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        initializer=[
            numpy_helper.from_array(np.array([[1]], np.int64), "i"),
            numpy_helper.from_array(np.array([2.0], np.float32), "u"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(ValueError, match=r"'mask'.*reduction='mul'.*supported: none, add"):
        qb.import_onnx(model)


def _conv_file(tmp_path) -> str:
    """Conv -> Relu on an input the file declares ``[batch, 3, h, w]``."""
    w = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((4, 3, 3, 3), np.float32), "w"
    )
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, "h", "w"])],
        initializer=[w],
    )  # fmt: skip
    path = str(tmp_path / "conv.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_quantize_says_which_declared_dimensions_dynamic_batch_fixes(tmp_path):
    # issue 12 part 5: a model never silently specialises a dimension its file declares dynamic
    module = qb.import_onnx(_conv_file(tmp_path))
    calib = [torch.randn(2, 3, 12, 12) for _ in range(2)]
    with pytest.warns(UserWarning, match=r"declares x\[2\] \('h'\), x\[3\] \('w'\) dynamic.*"
                      r"dynamic='batch' fixes them.*dynamic='all'"):  # fmt: skip
        qb.quantize(module, calib, dynamic="batch")
    with pytest.warns(UserWarning, match=r"x\[0\] \('batch'\), x\[2\]"):
        qb.quantize(module, calib, dynamic="none")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*declares.*dynamic")
        qmodel = qb.quantize(module, calib, dynamic="all")
    # and dynamic='all' keeps them: another image size runs
    assert qmodel(torch.randn(1, 3, 20, 16)).shape == (1, 4, 20, 16)
