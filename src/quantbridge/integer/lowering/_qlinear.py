"""Lowering of ONNX's integer operators QLinearConv, QLinearMatMul, ConvInteger, MatMulInteger
to the same kernels as their QDQ patterns (``_linear``): the integer operands carry their
(scale, zero point) as inputs of the node instead of DequantizeLinear nodes.

ConvInteger / MatMulInteger output the int32 accumulator itself: scale 1, zero point 0, and a
requantization multiplier of exactly 1 (``M = 1, n = 0``), so the kernel returns ``acc``.
"""

from __future__ import annotations

import numpy as np
import onnx

from .._program import Boundary, QTensor
from ._core import (
    Builder,
    Const,
    IndexValue,
    IntInput,
    LoweringError,
    QConst,
    QValue,
    Value,
    as_const,
    describe_node,
    node_name,
    register_lowering,
)
from ._linear import conv, matmul_act, matmul_const


def _scalar_param(node, v: Value | None, what: str, default: object = 0) -> np.ndarray:
    return np.asarray(default if v is None else as_const(node, v, what))


def _one(node, v: Value | None, what: str) -> np.ndarray:
    """A per-tensor parameter (any shape with one element) as a 0-d array."""
    a = np.asarray(as_const(node, v, what))
    if a.size != 1:
        raise LoweringError(f"{describe_node(node)}: {what} must hold one value, got {a.shape}")
    return a.reshape(())


def int_operand(b: Builder, node, v: Value | None, scale: float, zero: int) -> QTensor:
    """The program tensor of integer codes ``v``, read with (scale, zero point)."""
    if isinstance(v, QValue):
        return v.tensor
    if isinstance(v, IntInput):
        t = b.tensor(v.name, v.dtype, scale, zero)
        b.inputs.append(Boundary(v.name, t, False))
        return t
    if isinstance(v, Const) and np.issubdtype(v.array.dtype, np.integer):
        return b.constant(node_name(node) + "_operand", v.array, scale, zero)
    if isinstance(v, IndexValue) and not v.logical and v.tensor.dtype.itemsize <= 2:
        # integer codes computed by the graph: rows of an int8 table gathered by token ids
        # (ORT's QOperator embedding read by QLinearMatMul), the same integers on this grid
        t = b.tensor(node_name(node) + "_operand", v.tensor.dtype, scale, zero)
        b.step("cast", node_name(node) + "_operand", [v.tensor], t, dtype=t.dtype, logical=False)
        return t
    raise LoweringError(f"{describe_node(node)}: an operand is not integer codes")


def _weight(node, v: Value | None, scale: np.ndarray, zero: np.ndarray, axis: int) -> QConst:
    if not (isinstance(v, Const) and np.issubdtype(v.array.dtype, np.integer)):
        raise LoweringError(f"{describe_node(node)}: the weight must be an integer initializer")
    return QConst(v.array, scale, zero, axis if scale.size > 1 or zero.size > 1 else None)


def _output(b: Builder, node, pending, scale: float, zero: np.ndarray) -> list[Value]:
    out = b.tensor(node.output[0], zero.dtype, scale, int(zero))
    pending.realize(b, out, out.qmin, out.qmax)
    return [QValue(out, integer=True)]


def _pad(ins: list[Value | None], n: int) -> list[Value | None]:
    return list(ins) + [None] * (n - len(ins))


@register_lowering("QLinearConv")
def _qlinear_conv(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    x, xs, xz, w, ws, wz, ys, yz, bias = _pad(ins, 9)
    if any(a.name == "channels_last" and a.i for a in node.attribute):
        raise LoweringError(
            f"{describe_node(node)}: channels_last=1 is ONNX Runtime's NHWC layout "
            "(ORT_ENABLE_ALL's layout transformation); lower the QDQ file it was made from, or "
            "save the optimized model at ORT_ENABLE_EXTENDED"
        )
    x_scale, x_zero = float(_one(node, xs, "x_scale")), int(_one(node, xz, "x_zero_point"))
    xt = int_operand(b, node, x, x_scale, x_zero)
    w_scale = np.asarray(as_const(node, ws, "w_scale"))
    wq = _weight(node, w, w_scale, np.asarray(as_const(node, wz, "w_zero_point")), 0)
    bq = None
    if bias is not None:
        acc = np.float32(x_scale) * w_scale.astype(np.float32)
        bq = QConst(as_const(node, bias, "B"), acc, np.zeros(1, np.int64), 0)
    pending = conv(b, node, xt, x_scale, x_zero, wq, bq)
    return _output(b, node, pending, float(_one(node, ys, "y_scale")), _one(node, yz, "y_zp"))


@register_lowering("ConvInteger")
def _conv_integer(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    x, w, xz, wz = _pad(ins, 4)
    x_zero = int(_scalar_param(node, xz, "x_zero_point").reshape(-1)[0])
    xt = int_operand(b, node, x, 1.0, x_zero)
    wq = _weight(node, w, np.ones(1), _scalar_param(node, wz, "w_zero_point").reshape(-1), 0)
    pending = conv(b, node, xt, 1.0, x_zero, wq, None)
    return _output(b, node, pending, 1.0, np.zeros((), np.int32))


@register_lowering("QLinearMatMul")
def _qlinear_matmul(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    a, a_s, a_z, bv, b_s, b_z, ys, yz = _pad(ins, 8)
    a_scale, a_zero = float(_one(node, a_s, "a_scale")), int(_one(node, a_z, "a_zp"))
    at = int_operand(b, node, a, a_scale, a_zero)
    b_scale, b_zero = np.asarray(as_const(node, b_s, "b_scale")), as_const(node, b_z, "b_zp")
    pending = _matmul(b, node, at, a_scale, a_zero, bv, b_scale, np.asarray(b_zero))
    return _output(b, node, pending, float(_one(node, ys, "y_scale")), _one(node, yz, "y_zp"))


@register_lowering("MatMulInteger")
def _matmul_integer(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    a, bv, a_z, b_z = _pad(ins, 4)
    a_zero = int(_scalar_param(node, a_z, "a_zero_point").reshape(-1)[0])
    at = int_operand(b, node, a, 1.0, a_zero)
    pending = _matmul(b, node, at, 1.0, a_zero, bv, np.ones(1), _scalar_param(node, b_z, "b_zp"))
    return _output(b, node, pending, 1.0, np.zeros((), np.int32))


def _matmul(b, node, at: QTensor, a_scale, a_zero, bv, b_scale: np.ndarray, b_zero: np.ndarray):
    if isinstance(bv, Const) and bv.array.ndim == 2:
        wq = _weight(node, bv, b_scale, b_zero.reshape(-1), 1)
        return matmul_const(b, node, at, a_scale, a_zero, wq, None)
    if b_scale.size != 1 or b_zero.size != 1:
        raise LoweringError(f"{describe_node(node)}: per-column parameters need a 2-D constant B")
    bt = int_operand(b, node, bv, float(b_scale.reshape(())), int(b_zero.reshape(())))
    return matmul_act(b, node, at, a_zero, bt, bt.zero_point, a_scale * bt.scale)
