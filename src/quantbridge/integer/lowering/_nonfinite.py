"""Lowering of IsNaN / IsInf, and of a Where that selects by a constant condition or between
codes and a float constant on their grid.

Codes are never NaN or infinite: IsNaN / IsInf of integer codes (a quantized value, an integer
mask, an integer input or constant) is a constant false. One float value of the program is NaN
in float: a softmax row whose every score was masked with -inf is ``0 / 0`` there (ONNX
Runtime), and uniform in the program (``kernels._normalize``). torch's TorchScript exporter
writes exactly that for a boolean mask (``scaled_dot_product_attention``: ``Where(mask, 0,
-inf)`` added to the scores, then ``Where(IsNaN(p), 0, p)``, HF BERT). IsNaN of such a
probability tensor is read off the keep mask: ``max(keep, axis=-1) == 0`` (a ``reduce_max`` and
a ``compare`` step), and the ``Where`` that follows writes code 0 on those rows: exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx

from ...numerics import dequantize, quantize
from ._core import (
    Builder,
    Const,
    IndexValue,
    IntInput,
    LoweringError,
    QConst,
    QValue,
    Value,
    _kind,
    attrs_of,
    describe_node,
    index_input,
    node_name,
    register_lowering,
)


@dataclasses.dataclass(frozen=True)
class NanRows(IndexValue):
    """``IsNaN`` of the masked softmax probabilities ``source`` (a program tensor name): 1 on
    the rows with no kept score (broadcast along the last axis)."""

    source: str = ""


def _false(b: Builder, node: onnx.NodeProto, v: Value) -> Const:
    """A constant false of the input's shape (a scalar where it is not static)."""
    shape = b.shapes.get(node.input[0])
    if isinstance(v, QConst):
        shape = v.q.shape
    if shape is None or any(d is None for d in shape):
        shape = ()
    return Const(np.zeros(shape, bool))


@register_lowering("IsNaN", "IsInf")
def _is_nonfinite(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    v = ins[0]
    if isinstance(v, Const):
        a = attrs_of(node)
        x = np.asarray(v.array)
        if node.op_type == "IsNaN":
            return [Const(np.isnan(x))]
        pos, neg = bool(a.get("detect_positive", 1)), bool(a.get("detect_negative", 1))
        return [Const((np.isposinf(x) & pos) | (np.isneginf(x) & neg))]
    if node.op_type == "IsNaN" and isinstance(v, QValue) and v.nan_keep is not None:
        name = node_name(node)
        keep = v.nan_keep
        kept = b.like(name + "_kept", keep)
        b.step("reduce_max", name, [keep], kept, axes=(-1,), keepdims=True)
        zero = b.constant(name + "_zero", np.zeros((), keep.dtype), 1.0, 0)
        out = b.tensor(node.output[0], np.uint8, 1.0, 0)
        b.step("compare", name, [kept, zero], out, fn="Equal")
        return [NanRows(out, logical=True, source=v.tensor.name)]
    if isinstance(v, QValue | QConst | IndexValue | IntInput):
        return [_false(b, node, v)]  # codes / integers: never NaN or infinite
    raise LoweringError(
        f"{describe_node(node)}: {node.op_type} of {_kind(v)}; lowered only on quantized "
        "tensors, integer tensors and constants (codes are never NaN or infinite)"
    )


def _static(b: Builder, name: str) -> tuple[int, ...] | None:
    shape = b.shapes.get(name)
    return None if shape is None or any(d is None for d in shape) else tuple(shape)


def _on_grid(c: Const, t) -> np.ndarray | None:
    """The code of the scalar float constant ``c`` on ``t``'s grid, if ``c`` is exactly a
    value of that grid (float32 dequantization); None otherwise."""
    x = np.asarray(c.array)
    if x.dtype.kind != "f" or x.size != 1 or not np.isfinite(x).all():
        return None
    q = quantize(x.astype(np.float32), np.float32(t.scale), t.zero_point, t.qmin, t.qmax)
    back = dequantize(np.asarray(q), np.float32(t.scale), t.zero_point)
    if np.float32(back.reshape(())) != np.float32(x.reshape(())):
        return None
    return np.asarray(q).astype(t.dtype).reshape(())


def select_constant(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> Value | None:
    """``Where`` with (1) a constant condition that is all true or all false: the selected
    operand itself, when it already has the output's shape; (2) a run-time mask choosing
    between a quantized tensor and a float constant that lies on its grid (``Where(IsNaN(p),
    0, p)``): a ``where`` step on the codes, the constant as its code. None for any other."""
    cond, x, y = ins
    if isinstance(cond, Const) and np.asarray(cond.array).size:
        c = np.asarray(cond.array).astype(bool)
        if c.all() or not c.any():
            k = 1 if c.all() else 2
            out_shape, chosen = _static(b, node.output[0]), _static(b, node.input[k])
            other = ins[3 - k]
            if (out_shape is not None and out_shape == chosen) or (
                c.size == 1 and isinstance(other, Const) and np.asarray(other.array).size == 1
            ):
                return ins[k]
        return None
    if not isinstance(cond, IndexValue | IntInput):
        return None
    for k, (v, c) in enumerate(((x, y), (y, x))):
        if not (isinstance(v, QValue) and not v.integer and isinstance(c, Const)):
            continue
        code = _on_grid(c, v.tensor)
        if code is None:
            return None
        name = node_name(node)
        cond_t = (index_input(b, cond) if isinstance(cond, IntInput) else cond).tensor
        const_t = b.constant(name + "_fill", code, v.tensor.scale, v.tensor.zero_point)
        out = b.like(node.output[0], v.tensor)
        branches = [v.tensor, const_t] if k == 0 else [const_t, v.tensor]
        b.step("where", name, [cond_t, *branches], out, dtype=v.tensor.dtype)
        # the NaN rows are replaced when the mask is IsNaN(v) and v is the other branch
        cleared = k == 1 and isinstance(cond, NanRows) and cond.source == v.tensor.name
        row_sum = v.row_sum if int(code) == v.tensor.zero_point else None
        return QValue(out, row_sum=row_sum, nan_keep=None if cleared else v.nan_keep)
    return None
