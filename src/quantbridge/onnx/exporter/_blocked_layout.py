"""Group-wise weights of a MatMul in the layout ONNX Runtime fuses into ``MatMulNBits``.

``nn.Linear`` holds its weight as ``[N, K]``; a group-wise weight (``BlockWeightQuantizer``, blocks
along ``K``) exports as::

    DequantizeLinear(codes [N, K], scales [N, K/B], axis=1, block_size=B) -> Transpose(1, 0) -> MatMul

ONNX Runtime 1.32 fuses ``DequantizeLinear(block_size) -> MatMul`` into ``MatMulNBits`` only when
the DQ feeds the MatMul directly with ``[K, N]`` codes blocked along axis 0, the layout its own
quantizer and ModelOpt write (measured: the form above runs as ``FusedMatMul`` on a float weight
dequantized in full). This pass (Case 1) rewrites such a pair as::

    DequantizeLinear(codes^T [K, N], scales^T, zero points^T, axis=0, block_size=B) -> MatMul

which is exact: dequantization is element-wise and a transpose only permutes elements. A weight
blocked along ``N`` (``axis=0`` of ``[N, K]``, from a file blocked along axis 1 of ``[K, N]``)
is written back the same way with ``axis=1``: the file's own layout either way.

Case 2: a 2-D input exports ``nn.Linear`` as ``Gemm(x, DQ(codes [N, K]), transB=1)``; the codes
are transposed the same way and the Gemm gets ``transB=0`` (the Gemm computes the same product). Applied
only when the Transpose (perm ``[1, 0]``) is the DQ's only reader and the DQ's inputs are
initializers. An initializer read by other nodes too (a shared zero point) is copied transposed
under a new name; otherwise it is transposed in place and keeps its name (the export record and
the INT4 packing find it). Not applied: any other reader or layout (convolutions, a DQ read
twice).
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper


def untranspose_blocked_weights(model: onnx.ModelProto) -> int:
    """Apply Case 1 (see the module docstring) in place; returns how many pairs it rewrote."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    dropped, rewritten = [], 0
    for dq in graph.node:
        reader = _reader(dq, inits, readers, outputs)
        if reader is None:
            continue
        for i, name in enumerate(dq.input):
            if name:
                dq.input[i] = _transposed(graph, inits, readers, name, dq)
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1) % 2
        for a in list(dq.attribute):
            if a.name == "axis":
                dq.attribute.remove(a)
        dq.attribute.append(helper.make_attribute("axis", 1 - axis))
        if reader.op_type == "Transpose":  # Case 1
            dq.output[0] = reader.output[0]
            dropped.append(reader)
        else:  # Case 2
            for a in reader.attribute:
                if a.name == "transB":
                    a.i = 0
        rewritten += 1
    for node in dropped:
        graph.node.remove(node)
    return rewritten


def _reader(dq, inits, readers, outputs) -> onnx.NodeProto | None:
    """The Transpose of Case 1 or the Gemm of Case 2 that reads ``dq``, or None."""
    attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
    if dq.op_type != "DequantizeLinear" or not attrs.get("block_size"):
        return None
    codes = inits.get(dq.input[0])
    if codes is None or len(codes.dims) != 2:
        return None
    if any(name and name not in inits for name in dq.input) or dq.output[0] in outputs:
        return None
    users = readers.get(dq.output[0], [])
    if len(users) != 1:
        return None
    if users[0].op_type == "Gemm":  # Case 2
        gemm = users[0]
        trans_b = next((a.i for a in gemm.attribute if a.name == "transB"), 0)
        return gemm if trans_b == 1 and list(gemm.input).index(dq.output[0]) == 1 else None
    if users[0].op_type != "Transpose":
        return None
    transpose = users[0]
    perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), [1, 0])
    if perm != [1, 0] or not all(
        u.op_type == "MatMul" for u in readers.get(transpose.output[0], [])
    ):
        return None
    return transpose


def _transposed(graph, inits, readers, name: str, dq: onnx.NodeProto) -> str:
    """``name``'s initializer transposed: in place when ``dq`` is its only reader, else a copy."""
    init = inits[name]
    values = numpy_helper.to_array(init).T.copy()
    if all(r is dq for r in readers[name]):
        init.CopyFrom(numpy_helper.from_array(values, name))
        return name
    new = f"{name}_kn"
    if new not in inits:
        inits[new] = numpy_helper.from_array(values, new)
        graph.initializer.append(inits[new])
    return new
