"""The export record says which QuantizeLinear each quantizer call became where torch's ONNX
optimizer merged identical calls (``onnx/exporter/_merged_calls``): Llama exported with
``dynamic="all"`` has four rotary ``cos.unsqueeze(1)`` quantizer calls in three tensors, and
compare's torch-quant left 6 of 133 tensors unmatched."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from quantbridge.onnx.exporter._merged_calls import calls_after, quantize_calls

ir = pytest.importorskip("onnxscript.ir")


def _traced() -> onnx.ModelProto:
    """As the exporter translates a trace, before the optimizer: cos(x) unsqueezed in two
    blocks, each block's quantizer with its own (equal) scale initializer; a third quantizer,
    another step, on a third unsqueeze."""
    inits, nodes = [], [helper.make_node("Cos", ["x"], ["cos"])]
    for i, step in enumerate((0.01, 0.01, 0.02)):
        s, z = f"_quantbridge.u{i}.export_scale", f"_quantbridge.u{i}.export_zero_point"
        inits += [numpy_helper.from_array(np.float32(step), s),
                  numpy_helper.from_array(np.int8(0), z),
                  numpy_helper.from_array(np.array([1], np.int64), f"axes{i}")]  # fmt: skip
        nodes += [
            helper.make_node("Unsqueeze", ["cos", f"axes{i}"], [f"u{i}"]),
            helper.make_node("QuantizeLinear", [f"u{i}", s, z], [f"q{i}"]),
            helper.make_node("DequantizeLinear", [f"q{i}", s, z], [f"d{i}"]),
        ]
    nodes += [
        helper.make_node("Add", ["d0", "d1"], ["a"]),
        helper.make_node("Add", ["a", "d2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 1, 8])], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_calls_merged_by_the_optimizer_name_the_surviving_tensor():
    from torch.onnx._internal._lazy_import import onnxscript_apis  # torch's optimizer call

    model = ir.from_proto(_traced())
    before = quantize_calls(model.graph)
    assert [out for _, out, _ in before] == ["q0", "q1", "q2"]
    model = onnxscript_apis.optimize(model)
    proto = ir.to_proto(model)
    names = {n.output[0] for n in proto.graph.node if n.op_type == "QuantizeLinear"}
    assert len(names) == 2  # the premise: the optimizer merged the two equal calls
    calls = calls_after(before, names)
    first = calls["_quantbridge.u0.export_scale"]
    assert len(first) == 1 and first[0] in names
    assert calls["_quantbridge.u1.export_scale"] == first  # merged into the same tensor
    third = calls["_quantbridge.u2.export_scale"]
    assert third[0] in names and third != first
