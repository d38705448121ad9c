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


def int8_activation_products(model: onnx.ModelProto) -> list[str]:
    """Where ONNX Runtime (CPU) quantizes the activation of a weight-only product to int8, per row
    in blocks of ``block_size`` along K (symmetric, scale max|a| / 127; measured: that emulation
    equals ORT within 4e-6): a ``MatMulNBits`` with ``accuracy_level=4``, and a
    ``DequantizeLinear(block_size, axis=0) -> MatMul`` that its graph optimisation fuses into
    one (session option ``session.qdq_matmulnbits_accuracy_level``, default 4; not done with
    optimisations off). One line per case, naming the first node and the count."""
    level4 = [
        n
        for n in model.graph.node
        if n.op_type == "MatMulNBits"
        and any(a.name == "accuracy_level" and a.i == 4 for a in n.attribute)
    ]
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    fused = [
        n
        for n in model.graph.node
        if n.op_type == "DequantizeLinear"
        and {a.name: a.i for a in n.attribute}.get("block_size")
        and {a.name: a.i for a in n.attribute}.get("axis", 1) == 0
        and any(
            u.op_type == "MatMul" and u.input[1] == n.output[0] for u in users.get(n.output[0], [])
        )
    ]
    lines = []
    if level4:
        lines.append(
            f"MatMulNBits {level4[0].name!r} ({len(level4)} such) has accuracy_level=4: ONNX "
            "Runtime (ort-ref and ort alike) quantizes its input to int8 per block along K; "
            "torch-quant computes the op's float definition (the import warns) and differs by "
            "that rounding, not by an error"
        )
    if fused:
        lines.append(
            f"DequantizeLinear {fused[0].name!r} ({len(fused)} such) -> MatMul: ONNX Runtime's "
            "graph optimisation (engine 'ort') fuses it into MatMulNBits with accuracy_level 4 "
            "(int8 input per block along K); 'ort' then differs from 'ort-ref' and torch by that "
            "rounding, not by an error"
        )
    return lines
