"""ONNX op taxonomies: the one home of every table that sorts ONNX op types by how quantization
treats them. Plain data, no dependencies (bottom layer): the ONNX importer and inspector, the
demo, ``bench`` and the examples read these tables instead of keeping their own lists.

(Tables keyed by captured torch ops, such as ``torch._ops.WEIGHTED_OPS``, are torch's own and
live in ``quantbridge.torch._ops``.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightSlots:
    """Input positions of an op's weight, the weight's scale (None: no scale input) and bias."""

    weight: int
    scale: int | None = None
    bias: int | None = None


# Quantize / dequantize nodes of a QDQ graph.
QDQ_OPS: frozenset[str] = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})

# Float ops with a weight (an initializer input): op -> where its weight and bias are.
WEIGHTED_OPS: dict[str, WeightSlots] = {
    "Conv": WeightSlots(1, None, 2),
    "ConvTranspose": WeightSlots(1, None, 2),
    "Gemm": WeightSlots(1, None, 2),
    "MatMul": WeightSlots(1),
}

# ONNX Runtime's fused forms of the weighted ops (in a graph it optimized): still float compute.
ORT_FUSED_WEIGHTED_OPS: frozenset[str] = frozenset({"FusedConv", "FusedGemm", "FusedMatMul"})

# QOperator ops (ONNX and ONNX Runtime contrib ops that compute on integers): op -> where its
# integer weight, that weight's scale and its bias are (None: no weight input).
QOPERATOR_OPS: dict[str, WeightSlots | None] = {
    "QLinearConv": WeightSlots(3, 4, 8),
    "QLinearConvTranspose": WeightSlots(3, 4, 8),
    "QLinearMatMul": WeightSlots(3, 4),
    "QGemm": WeightSlots(3, 4, 6),
    "ConvInteger": WeightSlots(1),
    "MatMulInteger": WeightSlots(1),
    "DynamicQuantizeMatMul": WeightSlots(1, 2, 4),
    "MatMulIntegerToFloat": WeightSlots(1, 3, 6),
    "QLinearAdd": None,
    "QLinearMul": None,
    "QLinearConcat": None,
    "QLinearAveragePool": None,
    "QLinearGlobalAveragePool": None,
    "QLinearReduceMean": None,
    "QLinearSigmoid": None,
    "QLinearLeakyRelu": None,
    "QLinearSoftmax": None,
    "QLinearWhere": None,
    "QAttention": WeightSlots(1, 4),
}
INTEGER_OPS: frozenset[str] = frozenset(QOPERATOR_OPS)

# QOperator ops whose output is a quantized integer tensor (the others give int32 or float).
QUANTIZED_OUTPUT_OPS: frozenset[str] = frozenset(
    op for op in QOPERATOR_OPS if op.startswith(("QLinear", "QGemm"))
)

# Ops that move or select values without arithmetic: integer when their data inputs are.
DATA_MOVEMENT_OPS: frozenset[str] = frozenset(
    {"MaxPool", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Gather",
     "Concat", "Split", "Pad", "Resize", "Identity", "DepthToSpace", "SpaceToDepth", "Tile",
     "Expand", "GatherElements", "GatherND"}
)  # fmt: skip


# Ops whose output is >= 0 whatever their input (the exporter stores a symmetric int8 tensor
# they produce as uint8, ``onnx/exporter/_relu_quant``).
NONNEGATIVE_OUTPUT_OPS: frozenset[str] = frozenset({"Relu", "Sigmoid", "Softmax", "Exp", "Abs"})

# Ops whose output is >= 0 when all their data inputs are (no arithmetic that can go negative;
# Pad is left out: its constant can be negative). Data input: position 0, or all for Concat/Add/
# Mul/Max/Sum.
NONNEGATIVE_PRESERVING_OPS: frozenset[str] = frozenset(
    {"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceMax",
     "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Gather", "Split",
     "Resize", "Identity", "DepthToSpace", "SpaceToDepth", "Tile", "Expand", "Concat", "Add",
     "Mul", "Max", "Sum"}
)  # fmt: skip
NONNEGATIVE_ALL_INPUTS_OPS: frozenset[str] = frozenset({"Concat", "Add", "Mul", "Max", "Sum"})

# Layout ops ONNX Runtime moves a DequantizeLinear across (its QDQ propagation, and the transpose
# optimizer on a DequantizeLinear of a constant weight): ``DQ -> Transpose -> MatMul`` runs as a
# MatMul reading a DequantizeLinear.
DEQUANTIZE_TRANSPARENT_OPS: frozenset[str] = frozenset(
    {"Reshape", "Transpose", "Squeeze", "Unsqueeze"}
)

# ONNX Runtime's fused dynamic quantization (quantize_dynamic, then its graph optimisations): the op
# quantizes its float input itself, with a scale computed from each input at run time, so the
# codes are never a tensor of the file.
FUSED_DYNAMIC_OPS: frozenset[str] = frozenset(
    {"DynamicQuantizeMatMul", "MatMulIntegerToFloat", "DynamicQuantizeLSTM"}
)

# ONNX Runtime's weight-only contrib ops (MatMulNBitsQuantizer): group-wise (blocked) weights, float
# activations; no per-tensor / per-channel form exists to fold or lower them to.
GROUP_WISE_OPS: frozenset[str] = frozenset({"MatMulNBits", "GatherBlockQuantized"})

# Ops ONNX Runtime runs with int8 operands and a float output when every data input comes from a
# DequantizeLinear but no QuantizeLinear follows (MatMul -> MatMulIntegerToFloat).
INT8_FLOAT_OUTPUT_OPS: frozenset[str] = frozenset({"MatMul"})


def is_quantized_op(op_type: str) -> bool:
    """A QDQ node or a QOperator (any ``QLinear*`` op counts, known here or not)."""
    return op_type in QDQ_OPS or op_type in QOPERATOR_OPS or op_type.startswith("QLinear")


# Integer ops whose output is quantized: op -> input positions of the output scale and zero point
# (debug reads a QOperator graph's quantized tensors, and their steps, from these).
QOPERATOR_OUTPUT_QPARAMS: dict[str, tuple[int, int]] = {
    "QuantizeLinear": (1, 2),
    "QLinearConv": (6, 7),
    "QLinearConvTranspose": (6, 7),
    "QLinearMatMul": (6, 7),
    "QGemm": (7, 8),
    "QLinearAdd": (6, 7),
    "QLinearMul": (6, 7),
    "QLinearConcat": (0, 1),
    "QLinearAveragePool": (3, 4),
    "QLinearGlobalAveragePool": (3, 4),
    "QLinearReduceMean": (3, 4),
    "QLinearSigmoid": (3, 4),
    "QLinearLeakyRelu": (3, 4),
    "QLinearSoftmax": (3, 4),
}


# ONNX Runtime's contrib QOperator ops (com.microsoft) that are, by definition, one float op between
# DequantizeLinear of their operands and QuantizeLinear of the result: op -> that float op (the
# importer unfolds them into it, ``lower`` into the QDQ form, ``onnx.passes._unfold``).
QOPERATOR_FLOAT_OPS: dict[str, str] = {
    "QLinearAdd": "Add",
    "QLinearMul": "Mul",
    "QLinearConcat": "Concat",
    "QLinearSigmoid": "Sigmoid",
    "QLinearLeakyRelu": "LeakyRelu",
    "QLinearSoftmax": "Softmax",
    "QLinearAveragePool": "AveragePool",
    "QLinearGlobalAveragePool": "GlobalAveragePool",
    "QLinearReduceMean": "ReduceMean",
    "QLinearWhere": "Where",
    "QGemm": "Gemm",
}

# Ops whose output error is at most the sum of their inputs' errors (each input 1-Lipschitz):
# an error an input carried cannot grow through them (debug credits such carried errors).
UNIT_GAIN_OPS: frozenset[str] = DATA_MOVEMENT_OPS | frozenset(
    {"Add", "Sub", "Relu", "Clip", "Max", "Min", "AveragePool", "GlobalAveragePool",
     "GlobalMaxPool", "ReduceMean", "ReduceMax", "ReduceMin", "Sigmoid", "HardSigmoid", "Tanh",
     "QuantizeLinear", "DequantizeLinear", "QLinearAdd", "QLinearConcat", "QLinearAveragePool",
     "QLinearGlobalAveragePool", "QLinearReduceMean", "QLinearSigmoid"}
)  # fmt: skip
