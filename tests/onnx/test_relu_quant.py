"""Issue 13 part 4: every advertised preset passes the demo. Symmetric int8 activations (zero point
0: ``int8_symmetric``, ``pow2``) after a ReLU are exported in the form ONNX Runtime fuses
(``onnx/exporter/_relu_quant``): the Relu goes into the integer clamp and non-negative tensors are
stored as uint8 with zero point 0, exactly.

Checked as a user hits it: ``qb.export`` of such a model runs every Conv/Gemm in ONNX Runtime's
integer kernels (counted in the graph ONNX Runtime optimized), the file still computes what the
``QuantModel`` computes (ORT without optimizations: 0 LSB), and ``quantbridge demo --recipe ...``
passes. The rewrite's exactness is a property test against the unrewritten graph.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb
from quantbridge.demo import exact_here, run_demo
from quantbridge.onnx.exporter._relu_quant import relu_into_quantize
from quantbridge.onnx.inspector import inspect_model
from quantbridge.zoo import DigitsCNN, resnet18_style


def _session(model_or_path, optimized: str | None = None, level=None):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    if level is not None:
        options.graph_optimization_level = level
    if optimized is not None:
        options.optimized_model_filepath = optimized
    source = (
        model_or_path.SerializeToString()
        if isinstance(model_or_path, onnx.ModelProto)
        else (str(model_or_path))
    )
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _optimized_ops(path, tmp_path) -> collections.Counter:
    optimized = str(tmp_path / "ort_optimized.onnx")
    _session(path, optimized)
    return collections.Counter(n.op_type for n in onnx.load(optimized).graph.node)


@pytest.mark.parametrize("recipe", ["int8_symmetric", "pow2"])
@pytest.mark.parametrize(
    "model, shape, convs, gemms",
    [(DigitsCNN, (8, 1, 8, 8), 3, 2),
     pytest.param(lambda: resnet18_style(num_classes=10, width=8), (4, 3, 32, 32), 20, 1,
                  marks=pytest.mark.slow)],
    ids=["digits", "resnet18"],
)  # fmt: skip
def test_symmetric_presets_run_every_conv_and_gemm_in_integer_kernels(
    recipe, model, shape, convs, gemms, tmp_path
):
    torch.manual_seed(0)
    batches = [torch.rand(*shape) for _ in range(2)]
    qmodel = qb.quantize(model().eval(), batches, recipe=recipe, progress=False)
    path = tmp_path / "m.onnx"
    qb.export(qmodel, path, example_inputs=batches[0])

    fused = _optimized_ops(path, tmp_path)
    assert fused["QLinearConv"] == convs and fused["QGemm"] == gemms, fused
    assert not {"Conv", "FusedConv", "Gemm", "FusedGemm", "Relu"} & set(fused), fused
    report = inspect_model(path)  # inspect's static rule agrees with what ONNX Runtime fused
    assert report.int8_ops.get("Conv", 0) == convs and "Conv" not in report.float_ops

    # the file still computes the QuantModel's integers: node-by-node ORT is the exact reference
    x = torch.rand(*shape)
    with torch.no_grad():
        expected = qmodel(x).numpy()
    got = _session(path, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(
        None, {"x": x.numpy()}
    )[0]
    step = float(qmodel.output_quantizer().scale)
    assert np.abs(got - expected).max() / step < 0.5  # 0 LSB: same codes


def _graph(op: str, bounds: tuple[float, float] | None, scale: float, narrow: bool):
    """x -> op (Relu / Clip(a, b)) -> Q(scale, 0:int8) [-> Clip(-127, 127)] -> DQ -> y."""
    inits = [numpy_helper.from_array(np.array(scale, np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.int8), "z")]  # fmt: skip
    if op == "Relu":
        nodes = [helper.make_node("Relu", ["x"], ["r"])]
    else:
        inits += [
            numpy_helper.from_array(np.array(b, np.float32), n)
            for n, b in zip("ab", bounds, strict=True)
        ]
        nodes = [helper.make_node("Clip", ["x", "a", "b"], ["r"])]
    nodes.append(helper.make_node("QuantizeLinear", ["r", "s", "z"], ["q"]))
    last = "q"
    if narrow:
        inits += [
            numpy_helper.from_array(np.array(v, np.int8), n) for n, v in (("lo", -127), ("hi", 127))
        ]
        nodes.append(helper.make_node("Clip", ["q", "lo", "hi"], ["qc"]))
        last = "qc"
    nodes.append(helper.make_node("DequantizeLinear", [last, "s", "z"], ["y"]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model, x):
    return _session(model, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, {"x": x})[0]


@settings(max_examples=40, deadline=None)
@given(
    op=st.sampled_from(["Relu", "Clip"]),
    scale=st.floats(1e-3, 10.0),
    a=st.floats(0.0, 5.0),
    width=st.floats(0.0, 50.0),
    narrow=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_rewrite_computes_the_same_values(op, scale, a, width, narrow, seed):
    """Exact against the unrewritten graph, at ties (k + 1/2 steps), at the bounds, beyond the
    grid (saturation) and at +-inf."""
    scale = float(np.float32(scale))
    before = _graph(op, (a, a + width), scale, narrow)
    after = onnx.ModelProto()
    after.CopyFrom(before)
    rewritten, removed = relu_into_quantize(after)
    assert (rewritten, removed) == (1, 1)
    onnx.checker.check_model(after, full_check=True)
    assert [n.op_type for n in after.graph.node] == ["QuantizeLinear", "Clip", "DequantizeLinear"]
    rng = np.random.default_rng(seed)
    k = np.arange(-140, 141, dtype=np.float32)
    x = np.concatenate([
        rng.normal(0, 60 * scale, 500), (k + 0.5) * scale, k * scale, [a, a + width, -a],
        [np.inf, -np.inf, 3e9, -3e9, 0.0, -0.0],
    ]).astype(np.float32)  # fmt: skip
    np.testing.assert_array_equal(_run(after, x), _run(before, x))


def test_clip_keeping_negative_values_and_asymmetric_grids_are_left_alone():
    negative = _graph("Clip", (-1.0, 1.0), 0.01, narrow=False)
    assert relu_into_quantize(negative) == (0, 0)
    assert [n.op_type for n in negative.graph.node][0] == "Clip"
    asymmetric = _graph("Relu", None, 0.01, narrow=False)
    asymmetric.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.array(-5, np.int8), "z"))
    assert relu_into_quantize(asymmetric) == (0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["int8_symmetric", "pow2"])
def test_demo_passes_with_the_symmetric_presets(recipe):
    """``quantbridge demo --recipe int8_symmetric`` / ``--recipe pow2`` end in ``result: OK``:
    every Conv/Gemm in int8, ONNX Runtime within 1 LSB of torch on >= 99% of logits."""
    result = run_demo(epochs=4, recipe=recipe, log=lambda line: None)
    assert result.ok, result.format()
    assert result.float_ops.get("Conv", 0) == 0 and result.float_ops.get("Gemm", 0) == 0
    assert result.within_1_lsb >= 0.99


def test_symmetric_export_folds_and_lowers(tmp_path):
    """The uint8 post-ReLU form goes on through ``qb.fold`` (ONNX Runtime runs the folded file; a
    layer whose input is int8 and output uint8 stays QDQ: ONNX Runtime has no mixed-type
    QLinearConv) and ``qb.lower`` (integer Clip on codes narrows the requantization clamp)."""
    torch.manual_seed(0)
    batches = [torch.rand(8, 1, 8, 8) for _ in range(2)]
    # 7-bit weights where this CPU's u8 x s8 kernels saturate (quantbridge._platform)
    _, recipe = exact_here("int8_symmetric", log=lambda line: None)
    qmodel = qb.quantize(DigitsCNN().eval(), batches, recipe=recipe, progress=False)
    qdq, qop = tmp_path / "m.onnx", tmp_path / "m.qop.onnx"
    qb.export(qmodel, qdq, example_inputs=batches[0])
    qb.fold(qdq, qop)
    ops = collections.Counter(n.op_type for n in onnx.load(qop).graph.node)
    assert ops["QLinearConv"] == 2 and ops["QLinearAdd"] == 1 and ops["QGemm"] == 1, ops

    x = torch.rand(32, 1, 8, 8)
    reference = _session(qdq, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(
        None, {"x": x.numpy()}
    )[0]
    folded = _session(qop).run(None, {"x": x.numpy()})[0]
    lowered = next(iter(qb.lower(qdq).run({"x": x.numpy()}).values()))
    step = float(qmodel.output_quantizer().scale)
    # ORT's QOperator kernels requantize in float32, the integer program with a fixed-point
    # multiplier: at most 1 LSB from the float-scale QDQ reference (issue 10 part 4's bound)
    assert np.abs(folded - reference).max() / step < 1.5
    assert np.abs(lowered - reference).max() / step < 1.5
