"""Weight-only quantization: integer weights, float activations (NNCF's ``compress_weights``
INT8_ASYM / INT8_SYM, its INT4 backup layers, ModelOpt's and ONNX Runtime's group-wise files).
Such a file quantizes no activation: its only quantized tensors are constants read by
DequantizeLinear (per tensor, per channel or blocked) or by ONNX Runtime's ``MatMulNBits`` /
``GatherBlockQuantized``. This finds those readers so that lower names them and compare compares
the outputs instead of calling the model float."""

from __future__ import annotations

import numpy as np
import onnx

from ..optables import GROUP_WISE_OPS

# ops that quantize an activation (a run-time tensor) or compute on integers
_ACTIVATION_OPS = frozenset({
    "QuantizeLinear", "DynamicQuantizeLinear", "ConvInteger", "MatMulInteger",
    "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "DynamicQuantizeLSTM", "QGemm", "QAttention",
})  # fmt: skip


def _integer_constants(graph: onnx.GraphProto) -> set[str]:
    tensors = list(graph.initializer) + [
        a.t for n in graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"
    ]
    found = set()
    for t in tensors:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        if np.dtype(dtype).kind in "iu" or t.data_type in (
            onnx.TensorProto.INT4,
            onnx.TensorProto.UINT4,
        ):
            found.add(t.name)
    return found


def weight_only_readers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes reading integer weights of a weight-only model (DequantizeLinear of an integer
    constant, ``MatMulNBits``, ``GatherBlockQuantized``); empty when the model quantizes an
    activation anywhere (then it is a QDQ / QOperator / dynamic model) or no weight."""
    nodes = model.graph.node
    ops = {n.op_type for n in nodes}
    if ops & _ACTIVATION_OPS or any(op.startswith("QLinear") for op in ops):
        return []
    consts = _integer_constants(model.graph)
    return [
        n for n in nodes
        if n.op_type in GROUP_WISE_OPS
        or (n.op_type == "DequantizeLinear" and n.input and n.input[0] in consts)
    ]  # fmt: skip
