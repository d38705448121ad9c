"""Graph facts for the inspector: producers, consumers, constants and element types of one ONNX
graph's tensors (``Graph``), and the integer types' names, ranges and bit counts."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from ...optables import DATA_MOVEMENT_OPS, DEQUANTIZE_TRANSPARENT_OPS, QUANTIZED_OUTPUT_OPS
from .._graph_index import GraphIndex

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
)
QUANT_TYPES = frozenset(
    {TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16,
     TensorProto.INT4, TensorProto.UINT4}
)  # fmt: skip


def type_name(data_type: int | None) -> str:
    if data_type is None:
        return "?"
    return TensorProto.DataType.Name(data_type).lower()


def type_range(data_type: int) -> tuple[int, int]:
    info = {
        TensorProto.INT4: (-8, 7),
        TensorProto.UINT4: (0, 15),
    }
    if data_type in info:
        return info[data_type]
    ii = np.iinfo(onnx.helper.tensor_dtype_to_np_dtype(data_type))
    return int(ii.min), int(ii.max)


def bits_for_range(lo: int, hi: int) -> int:
    """Fewest bits of a signed (``lo < 0``) or unsigned integer type holding ``[lo, hi]``."""
    bits = 1
    if lo < 0:
        while not (-(1 << (bits - 1)) <= lo and hi <= (1 << (bits - 1)) - 1):
            bits += 1
    else:
        while hi > (1 << bits) - 1:
            bits += 1
    return bits


# -- graph facts --------------------------------------------------------------------------------
class Graph(GraphIndex):
    """Producers, consumers, constants and element types of one graph's tensors."""

    def __init__(self, model: onnx.ModelProto):
        graph = model.graph
        initializers = {init.name: init for init in graph.initializer}
        super().__init__(list(graph.node), initializers, (o.name for o in graph.output))
        self.dtype: dict[str, int] = {t: c.data_type for t, c in self.constants.items()}
        for v in value_infos(model):
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
                self.dtype.setdefault(v.name, v.type.tensor_type.elem_type)
        self._propagate_quantized_types()

    def _propagate_quantized_types(self) -> None:
        """Element types shape inference cannot give (com.microsoft ops and what follows them)."""
        for n in self.nodes:
            if not n.output or not n.output[0] or n.output[0] in self.dtype:
                continue
            if n.op_type in ("QuantizeLinear", "DynamicQuantizeLinear"):
                self.dtype[n.output[0]] = self.quantize_type(n)
            elif n.op_type in QUANTIZED_OUTPUT_OPS:
                self.dtype[n.output[0]] = self.dtype.get(n.input[0], TensorProto.UINT8)
            elif n.op_type in DATA_MOVEMENT_OPS and n.input and n.input[0] in self.dtype:
                for out in n.output:
                    self.dtype.setdefault(out, self.dtype[n.input[0]])

    def quantize_type(self, node: onnx.NodeProto) -> int:
        """Integer type a QuantizeLinear produces: its zero point's, ``output_dtype``, or uint8."""
        if len(node.input) > 2 and node.input[2] in self.dtype:
            return self.dtype[node.input[2]]
        for a in node.attribute:
            if a.name == "output_dtype" and a.i:
                return a.i
        return TensorProto.UINT8

    def is_float_data(self, tensor: str) -> bool:
        return self.dtype.get(tensor) in FLOAT_TYPES or tensor not in self.dtype

    def is_quantized(self, tensor: str) -> bool:
        return self.dtype.get(tensor) in QUANT_TYPES

    def produced_by(self, tensor: str, op_type: str) -> bool:
        n = self.producer.get(tensor)
        return n is not None and n.op_type == op_type

    def _through_layout(self, tensor: str) -> str:
        """``tensor`` traced back through layout ops (``DEQUANTIZE_TRANSPARENT_OPS``)."""
        for _ in range(16):
            n = self.producer.get(tensor)
            if n is None or n.op_type not in DEQUANTIZE_TRANSPARENT_OPS:
                break
            tensor = n.input[0]
        return tensor

    def dequantized(self, tensor: str) -> bool:
        """Comes from a DequantizeLinear, directly or through layout ops ONNX Runtime moves the
        DequantizeLinear across (``DQ(int8 W) -> Transpose -> MatMul``)."""
        return self.produced_by(self._through_layout(tensor), "DequantizeLinear")

    def constant_layout(self, node: onnx.NodeProto) -> bool:
        """A layout op on a constant or a DequantizeLinear of one (a weight's Transpose): folded
        by the engine, no run-time work."""
        if node.op_type not in DEQUANTIZE_TRANSPARENT_OPS or not node.input:
            return False
        source = self._through_layout(node.input[0])
        producer = self.producer.get(source)
        if producer is not None and producer.op_type == "DequantizeLinear":
            source = producer.input[0]
        return source in self.constants


def value_infos(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # unknown ops or broken shapes: fall back to what the file declares
        inferred = model
    g = inferred.graph
    return list(g.input) + list(g.output) + list(g.value_info)
