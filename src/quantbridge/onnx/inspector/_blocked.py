"""Group-wise (blocked) weights in ``inspect``: the granularity of an opset-21
``DequantizeLinear(block_size)`` and the weight of ONNX Runtime's ``MatMulNBits``.

``MatMulNBits`` holds its weight packed (``uint8 [N, blocks, block_size * bits / 8]``, see
``importer._nbits``); the report shows it as what it stores: ``uint{bits}`` codes of shape
``[K, N]``, ``bits`` from the attribute, ``per-block(axis=0, block_size=B)``, and the range of the
unpacked codes. The op itself is a float matmul on the dequantized weight (weight-only
quantization), so it stays among the float ops.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ..importer._nbits import unpack_low_first
from ._graph import Graph
from ._report import WeightInfo


def block_granularity(dq: onnx.NodeProto, axis: int) -> str | None:
    """``per-block(axis=a, block_size=B)`` for a blocked DequantizeLinear, else None."""
    block = next((a.i for a in dq.attribute if a.name == "block_size"), 0)
    return f"per-block(axis={axis}, block_size={block})" if block else None


def matmul_nbits_weight(g: Graph, node: onnx.NodeProto, index: int) -> WeightInfo | None:
    """The weight of a ``MatMulNBits`` node (None when ``B`` is not a constant)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    packed = g.array(node.input[1]) if len(node.input) > 1 else None
    if packed is None:
        return None
    k, n, bits, block = (int(attrs.get(a, 0)) for a in ("K", "N", "bits", "block_size"))
    codes = unpack_low_first(packed.reshape(n, -1), bits, packed.size // max(n, 1) * 8 // bits)
    codes = codes[:, :k]
    zero = (
        "zero points" if len(node.input) > 3 and node.input[3] else f"zero point {2 ** (bits - 1)}"
    )
    return WeightInfo(
        node=node.name or f"#{index}",
        op_type=node.op_type,
        name=node.input[1],
        dtype=f"uint{bits}",
        shape=(k, n),
        is_float=False,
        bits=bits,
        granularity=f"per-block(axis=0, block_size={block}, {zero})",
        value_range=(float(codes.min()), float(codes.max())) if codes.size else None,
        bias_dtype=None,
    )
