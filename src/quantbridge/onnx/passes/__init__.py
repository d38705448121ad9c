"""ONNX-to-ONNX graph passes. ``FoldQOperator`` (``fold``): QDQ ONNX -> ONNX integer operators.
``openvino_layout``: a QDQ model with Q/DQ pairs only where OpenVINO runs int8 (``_openvino``).
``UnfoldQOperator`` (``unfold``): ONNX Runtime's contrib QOperator ops (QLinearAdd, QGemm, ...)
back to ``DQ -> float op -> Q``, their definition (``_unfold``, whose docstring numbers its cases).
``qonnx_to_qcdq``: QONNX's ``Quant`` op (Brevitas ``export_qonnx``, FINN) as Q -> Clip -> DQ
(``onnx/_qonnx``); import, fold and lower apply it first.

A pass is stateless and follows one contract, ``Pass()(model) -> PassResult(model, modified)``.
Fold handlers live in a registry keyed by op type (``@register_fold("Conv")``, ``_registry``).

Rewrite cases of ``FoldQOperator`` (each labelled ``# Case n`` where it is implemented):

1. ``DQ -> M`` becomes ``M -> DQ`` for M in ``INTEGER_DATA_MOVEMENT`` (MaxPool, Reshape, Flatten,
   Transpose, Squeeze, Unsqueeze, Slice, Resize nearest, Identity): M runs on the integers.
   A per-channel weight DQ moves below a Transpose by transposing the stored integers.
2. ``M -> Q`` becomes ``Q -> M`` for the same ops.
3. ``DQ -> Q`` with the same parameters cancels (the readers of Q read DQ's input).
   (3b, 3c in ``_normalize``: a Q in front of a Relu/Clip; a Clip of integer constant codes.)
4. ``Conv`` -> ``QLinearConv`` (grouped and depthwise included).
5. ``Gemm`` -> ``QGemm`` (com.microsoft).
6. ``MatMul`` -> ``QLinearMatMul``.
7. ``MatMul`` + ``Add(bias)`` (nn.Linear, any input rank) -> ``QGemm``.
8. ``Add`` (or two-input ``Sum``) / ``Mul`` -> ``QLinearAdd`` / ``QLinearMul`` (com.microsoft).
9. ``Concat`` -> ``QLinearConcat`` (com.microsoft), or ``Concat`` when all parameters agree.
10. ``AveragePool`` -> ``QLinearAveragePool`` (com.microsoft).
11. ``GlobalAveragePool`` / spatial ``ReduceMean`` -> ``QLinearGlobalAveragePool``.
12. ``Sigmoid`` / ``LeakyRelu`` -> ``QLinearSigmoid`` / ``QLinearLeakyRelu`` (com.microsoft).
13. A ``Relu`` / ``Clip`` (ReLU6) between an op and its output Q is absorbed into the
    requantization range, only when exact: ``Q(lo) == qmin`` and ``Q(hi) == qmax``.
14. ``DQ -> Relu/Clip -> Q`` with one set of parameters -> ``Clip`` on the integers.

Cases 1-3 only move or remove Q/DQ nodes whose parameters make the move exact (per tensor).
Cases 4-14 replace ``DQ(inputs) -> op -> Q`` by one integer op that reads the DQs' integer inputs
and writes the Q's integer output; they differ from the QDQ graph run by ONNX Runtime only where
ONNX Runtime itself runs the op in float between the Q/DQ (e.g. a spatial ReduceMean), by at
most one output step at float rounding ties.
"""

from .._qonnx import qonnx_to_qcdq
from ._fold import FoldQOperator, PassResult, check_foldable, fold
from ._normalize import INTEGER_DATA_MOVEMENT
from ._openvino import openvino_layout
from ._registry import foldable_ops, register_fold
from ._unfold import UnfoldQOperator, unfold, unfoldable_ops

__all__ = [
    "INTEGER_DATA_MOVEMENT",
    "FoldQOperator",
    "PassResult",
    "UnfoldQOperator",
    "check_foldable",
    "fold",
    "foldable_ops",
    "openvino_layout",
    "qonnx_to_qcdq",
    "register_fold",
    "unfold",
    "unfoldable_ops",
]
