"""Lowering of integer and bool arithmetic on the model's own integer tensors: attention masks
(``mask`` int64 -> Cast bool -> GatherND / Unsqueeze / Expand -> And / Not), position and token
ids (CumSum, Equal, Where), and a Gather by run-time indices (an embedding lookup).

These tensors are not codes of real values: they are ``IndexValue``s (scale 1, zero point 0),
and every step on them (``kernels._index``) is exact. An integer graph input that such an op
reads becomes an integer program input; an op whose inputs are all constants is folded (Range,
Max / Min of shape arithmetic). ``Gather(table, ids)`` with run-time ids looks the table up in
the program: a float table followed by its QuantizeLinear is quantized on that grid at lowering
(exact: quantizing then gathering is gathering then quantizing), an integer one (QConst, a
dequantized int8 table) keeps its codes. ArgMax / ArgMin of ids or of codes, an integer Concat
and a GatherND by run-time indices make CLIP's pooling at the EOS token.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import numpy_helper

from ...numerics import quantize
from .._program import QTensor
from ..kernels import KERNELS
from ..kernels._index import ARITH, COMPARE, LOGIC
from ._core import (
    Builder,
    Const,
    Elementwise,
    IndexValue,
    IntInput,
    LoweringError,
    MaskedScores,
    Pending,
    QConst,
    QValue,
    Value,
    _kind,
    attrs_of,
    compose,
    describe_node,
    held,
    index_input,
    node_name,
    register_lowering,
)
from ._movement import _const_indices, moved
from ._nonfinite import select_constant
from ._qdq import dequantize_const, rescale_sum
from ._select import fill_on_grid

ONNX_TYPES = {onnx.TensorProto.BOOL: np.dtype(bool), onnx.TensorProto.INT8: np.dtype(np.int8),
              onnx.TensorProto.UINT8: np.dtype(np.uint8), onnx.TensorProto.INT16: np.dtype(np.int16),
              onnx.TensorProto.INT32: np.dtype(np.int32), onnx.TensorProto.INT64: np.dtype(np.int64)}  # fmt: skip


FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16}


def _operand(b: Builder, node: onnx.NodeProto, v: Value | None) -> IndexValue | Const:
    if isinstance(v, IntInput):
        return index_input(b, v)
    if isinstance(v, IndexValue):
        return v
    if isinstance(v, Const) and (v.array.dtype == bool or np.issubdtype(v.array.dtype, np.integer)):
        return v
    if (isinstance(v, Const) and v.array.dtype.kind == "f" and np.isfinite(v.array).all()
            and np.all(v.array == np.trunc(v.array))):  # fmt: skip
        return Const(v.array.astype(np.int64))  # 1.0 - mask: integers written as floats
    raise LoweringError(
        f"{describe_node(node)}: reads {_kind(v)}; only integer / bool tensors (masks, ids) are "
        "lowered for this op. On quantized float values it has no integer lowering"
    )


def _tensor(b: Builder, node: onnx.NodeProto, v: IndexValue | Const) -> QTensor:
    """A program tensor of ``v`` (a constant operand becomes a program constant)."""
    if isinstance(v, IndexValue):
        return v.tensor
    return b.constant(node_name(node) + "_const", v.array.astype(held(v.array.dtype)), 1.0, 0)


def _integer_step(
    b, node, ins, step_op: str, out_dtype, fold, is_bool: bool, **attrs
) -> list[Value]:
    """One integer step, or a constant when every input is one (``fold`` on the arrays)."""
    vs = [_operand(b, node, v) for v in ins]
    if all(isinstance(v, Const) for v in vs):
        return [Const(np.asarray(fold(*(v.array for v in vs))))]
    out = b.tensor(node.output[0], held(out_dtype), 1.0, 0)
    b.step(step_op, node_name(node), [_tensor(b, node, v) for v in vs], out, **attrs)
    return [IndexValue(out, is_bool)]


def _dtype(v: IndexValue | Const) -> np.dtype:
    if isinstance(v, Const):
        return v.array.dtype
    return np.dtype(bool) if v.logical else v.tensor.dtype


@register_lowering(*LOGIC)
def _logic(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    return _integer_step(b, node, ins, "logic", bool, LOGIC[node.op_type], True, fn=node.op_type)


@register_lowering(*COMPARE)
def _compare(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    fold = COMPARE[node.op_type]
    if any(isinstance(v, QValue | Elementwise) and not getattr(v, "integer", False) for v in ins):
        composed = compose(node, ins, lambda *r: fold(*r).astype(np.float64))
        if composed is not None:  # Mamba's softplus threshold: Greater(x, 20) of x's codes
            return [composed]
    return _integer_step(b, node, ins, "compare", bool, fold, True, fn=node.op_type)


def integer_arithmetic(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """Add / Sub / Mul of integer tensors (RoBERTa's ``cumsum(mask) * mask + padding_idx``),
    called by the Add / Sub / Mul lowering when an operand is an integer tensor of the model."""
    if node.op_type not in ARITH:
        raise LoweringError(f"{describe_node(node)}: {node.op_type} of integer tensors")
    vs = [_operand(b, node, v) for v in ins]
    if any(isinstance(v, IndexValue) and v.logical for v in vs):
        raise LoweringError(f"{describe_node(node)}: arithmetic on a bool tensor (cast it first)")
    dtype = np.result_type(*(_dtype(v) for v in vs))
    return _integer_step(b, node, vs, "arith", dtype, ARITH[node.op_type], False,
                         fn=node.op_type, dtype=dtype)  # fmt: skip


# a fill whose exp underflows to exactly 0 next to any score: -inf, or finfo(float32).min
# (transformers' masks), far below the -104 that float32 exp needs under the row maximum
MASK_FILL = -1e30


def _fill(v: Value | None) -> bool:
    return (isinstance(v, Const) and v.array.dtype.kind == "f" and v.array.size == 1
            and float(v.array.reshape(())) <= MASK_FILL)  # fmt: skip


def _nan_rows(fill: Value | None) -> bool:
    """A -inf fill: a softmax row with every score masked is 0 / 0 = NaN in float."""
    return bool(np.isneginf(np.asarray(fill.array, np.float64)).all())


@register_lowering("Where")
def _where(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """On integer / bool tensors: a ``where`` step. ``Where(mask, -inf, scores)`` and
    ``Where(keep, scores, -inf)`` on quantized scores: ``MaskedScores`` for the Softmax after it
    (a ``Not`` step makes ``keep`` from ``mask``)."""
    cond, x, y = ins
    if isinstance(cond, Elementwise):  # Where(x > 20, x, softplus(x)): a function of x
        composed = compose(node, ins, lambda c, p, q: np.where(c != 0, p, q))
        if composed is not None:
            return [composed]
    selected = select_constant(b, node, ins)
    if selected is not None:
        return [selected]
    if _fill(x) or _fill(y):
        keep = _operand(b, node, cond)
        nan_rows = _nan_rows(x if _fill(x) else y)
        fill = float(np.asarray((x if _fill(x) else y).array).reshape(()))
        if isinstance(keep, Const):  # a causal mask of static shape: a program constant
            kept = np.asarray(keep.array).astype(bool)
            kept = ~kept if _fill(x) else kept
            t = b.constant(node_name(node) + "_keep", kept.astype(np.uint8), 1.0, 0)
            return [MaskedScores(y if _fill(x) else x, t, node_name(node), nan_rows, fill)]
        if _fill(x):  # Where(mask, -inf, scores): keep where the mask is false
            keep = _integer_step(b, node, [keep], "logic", bool, None, True, fn="Not")[0]
        return [MaskedScores(y if _fill(x) else x, keep.tensor, node_name(node), nan_rows, fill)]
    if all(isinstance(v, QValue) and not v.integer for v in (x, y)):
        return [_select_quantized(b, node, cond, x, y)]
    filled = fill_on_grid(b, node, lambda: _tensor(b, node, _operand(b, node, cond)), x, y)
    if filled is not None:
        return [filled]
    if not all(isinstance(v, IntInput | IndexValue | Const) for v in ins) or any(
        isinstance(v, Const) and v.array.dtype.kind == "f" for v in ins[1:]
    ):
        raise LoweringError(
            f"{describe_node(node)}: selects float values; lowered are a Where on integer / bool "
            f"tensors and a mask in front of a Softmax, Where(mask, fill, scores) with a fill "
            f"<= {MASK_FILL:g} (-inf, finfo(float32).min): replace other fills by -inf"
        )
    vs = [_operand(b, node, v) for v in ins]
    dtype = np.result_type(_dtype(vs[1]), _dtype(vs[2]))
    return _integer_step(b, node, vs, "where", dtype, lambda c, x, y: np.where(c, x, y),
                         dtype.kind == "b", dtype=held(dtype))  # fmt: skip


def additive_mask(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> MaskedScores | None:
    """``Add(scores, Where(keep, 0, fill))`` (either order; ``Where(mask, fill, 0)`` too):
    transformers' eager attention adds a float mask, 0 where a key is kept and finfo.min where
    not, to the scores. The ``Where`` lowered to ``MaskedScores`` of a zero constant; the sum is
    the scores masked the same way (``fill + score`` is ``fill`` in float32 for every finite
    8-bit score, so its exp is exactly 0 next to any kept one). The same for a hand-written
    ``(1 - mask) * finfo.min`` that the recipe quantized: a tensor whose grid has no positive
    value (zero point = qmax) and a step >= 1e30, so every code but the zero point is a fill:
    ``keep = (q == z)``. None for any other Add."""
    if node.op_type != "Add" or len(ins) != 2:
        return None
    for mask, scores in (ins, ins[::-1]):
        if (isinstance(mask, QValue) and not mask.integer and mask.tensor.scale >= -MASK_FILL
                and mask.tensor.zero_point == mask.tensor.qmax
                and isinstance(scores, QValue | Elementwise)):  # fmt: skip
            t = mask.tensor
            zero = Const(np.asarray(t.zero_point, t.dtype))
            keep = _integer_step(b, node, [IndexValue(t), zero], "compare", bool,
                                 COMPARE["Equal"], True, fn="Equal")[0]  # fmt: skip
            fill = float((t.qmin - t.zero_point) * np.float32(t.scale))
            return MaskedScores(scores, keep.tensor, node_name(node), fill=fill)
        if (isinstance(mask, MaskedScores) and isinstance(mask.scores, Const)
                and not np.any(mask.scores.array)
                and not isinstance(scores, MaskedScores | Const)):  # fmt: skip
            return MaskedScores(scores, mask.keep, node_name(node), mask.nan_rows, mask.fill)
    return None


def _select_quantized(b: Builder, node: onnx.NodeProto, cond, x: QValue, y: QValue) -> Pending:
    """``Where(mask, DQ(a), DQ(b)) -> Q`` (ONNX Runtime's QLinearWhere, unfolded): each operand
    requantized to the output grid (a one-input ``rescale_sum``; none where its grid is the
    output's), then a ``where`` step on the codes. Exact: selecting commutes with the
    elementwise requantization."""
    keep = _tensor(b, node, _operand(b, node, cond))
    name = node_name(node)

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        parts = []
        for k, t in enumerate((x.tensor, y.tensor)):
            same = (t.scale, t.zero_point, t.dtype) == (out.scale, out.zero_point, out.dtype)
            if same and qmin <= t.qmin and t.qmax <= qmax:
                parts.append(t)
                continue
            part = builder.tensor(f"{name}_{'xy'[k]}", out.dtype, out.scale, out.zero_point)
            rescale_sum(builder, name, [t], part, qmin, qmax)
            parts.append(part)
        builder.step("where", name, [keep, *parts], out, dtype=out.dtype)

    return Pending(name, realize)


@register_lowering("Cast")
def _cast(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    to = int(attrs_of(node)["to"])
    v = ins[0]
    if isinstance(v, Const):
        dtype = onnx.helper.tensor_dtype_to_np_dtype(to)
        return [Const(v.array.astype(dtype))]
    if to in FLOAT_TYPES and isinstance(v, IndexValue | IntInput):
        # the same integers as float values (exact below 2**24): a mask made float and then
        # quantized (DeBERTa's embeddings * mask) is requantized at its QuantizeLinear (_qdq)
        x = _operand(b, node, v)
        return [IndexValue(x.tensor, logical=False)]
    if to not in ONNX_TYPES:
        raise LoweringError(
            f"{describe_node(node)}: casts {_kind(v)} to "
            f"{onnx.TensorProto.DataType.Name(to)}; only casts between integer / bool types are "
            "lowered (a mask made float in the graph has no integer lowering)"
        )
    dtype = ONNX_TYPES[to]
    return _integer_step(b, node, [v], "cast", dtype, lambda x: x.astype(dtype),
                         dtype.kind == "b", dtype=held(dtype), logical=dtype.kind == "b")  # fmt: skip


@register_lowering("CumSum")
def _cumsum(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    if not isinstance(ins[1], Const):
        raise LoweringError(f"{describe_node(node)}: the axis must be a constant")
    a = attrs_of(node)
    attrs = {"axis": int(np.asarray(ins[1].array).reshape(-1)[0]),
             "exclusive": bool(a.get("exclusive", 0)), "reverse": bool(a.get("reverse", 0))}  # fmt: skip
    x = _operand(b, node, ins[0])
    if isinstance(x, IndexValue) and x.logical:
        raise LoweringError(f"{describe_node(node)}: CumSum of a bool tensor (cast it first)")
    from ..kernels._index import cumsum

    return _integer_step(b, node, [x], "cumsum", _dtype(x), lambda y: cumsum(attrs, y),
                         False, **attrs)  # fmt: skip


@register_lowering("Range")
def _range(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    if not all(isinstance(v, Const) for v in ins):
        raise LoweringError(
            f"{describe_node(node)}: its limits are not constants; lower with "
            "input_shapes={name: shape} (`--input-shape` on the CLI) so the shape arithmetic "
            "in front of it folds"
        )
    start, limit, delta = (np.asarray(v.array).reshape(()) for v in ins)
    return [Const(np.arange(start, limit, delta, dtype=start.dtype))]


@register_lowering("ConstantOfShape")
def _constant_of_shape(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """A filled tensor of a static shape (TorchScript BERT's ``ones(input_shape)`` mask and
    ``zeros`` token types): a constant that the ops after it fold."""
    if not isinstance(ins[0], Const):
        raise LoweringError(
            f"{describe_node(node)}: its shape is not a constant; lower with "
            "input_shapes={name: shape} (`--input-shape` on the CLI) so the shape arithmetic "
            "in front of it folds"
        )
    value = attrs_of(node).get("value")
    fill = (
        numpy_helper.to_array(value).reshape(-1) if value is not None else np.zeros(1, np.float32)
    )
    shape = tuple(int(d) for d in np.asarray(ins[0].array).reshape(-1))
    return [Const(np.full(shape, fill[0], dtype=fill.dtype))]


@register_lowering("Max", "Min")
def _extreme(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    if not all(isinstance(v, Const) for v in ins):
        raise LoweringError(
            f"{describe_node(node)}: an elementwise {node.op_type} of tensors computed at run time "
            "is not lowered (only of constants: shape arithmetic, folded)"
        )
    fn = np.maximum if node.op_type == "Max" else np.minimum
    out = ins[0].array
    for v in ins[1:]:
        out = fn(out, v.array)
    return [Const(np.asarray(out))]


@register_lowering("Gather")
def _gather(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """Constant indices: data movement (``_movement``). Run-time indices: a ``take`` step."""
    data, indices = ins[0], ins[1]
    axis = int(attrs_of(node).get("axis", 0))
    if isinstance(indices, Const):
        attrs = {"indices": np.asarray(_const_indices(node, indices)), "axis": axis}
        if (isinstance(data, QConst) and data.axis is not None and np.size(data.scale) > 1
                and data.axis % data.q.ndim == axis % data.q.ndim):  # fmt: skip
            # rows of a per-row table (NNCF's token types, index 0): their float values
            data = Const(np.asarray(dequantize_const(data), np.float32))
        return [moved(b, node, data, "gather", attrs)]
    idx = _operand(b, node, indices)
    name = node_name(node)
    if isinstance(data, QValue | IndexValue):
        out = b.like(node.output[0], data.tensor)
        b.step("take", name, [data.tensor, idx.tensor], out, axis=axis)
        return [QValue(out, data.integer) if isinstance(data, QValue)
                else IndexValue(out, data.logical)]  # fmt: skip
    if isinstance(data, QConst) and (
        data.axis is None or data.axis % data.q.ndim != axis % data.q.ndim
    ):
        if np.asarray(data.scale).size > 1:
            raise LoweringError(f"{describe_node(node)}: a per-channel table is not lowered")
        table = b.constant(name + "_table", data.q, float(data.scale), int(data.zero_point))
        out = b.like(node.output[0], table)
        b.step("take", name, [table, idx.tensor], out, axis=axis)
        return [QValue(out)]
    if isinstance(data, QConst):  # scales along the gathered axis (NNCF's per-row table)
        data = Const(np.asarray(dequantize_const(data), np.float32))
    if isinstance(data, Const) and data.array.dtype.kind == "f":
        table_values = data.array

        def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
            codes = quantize(table_values, np.float32(out.scale), out.zero_point, qmin, qmax)
            table = builder.constant(name + "_table", np.asarray(codes).astype(out.dtype),
                                     out.scale, out.zero_point)  # fmt: skip
            builder.step("take", name, [table, idx.tensor], out, axis=axis)

        # the rows' values as the float op reads them; bound: a float sum of such rows (NNCF's
        # embedding sum) is realized on int16 codes of it (_eltwise._float_sums_on_int16_grid)
        peak = float(np.abs(table_values).max()) if table_values.size else 0.0
        return [Pending(name, realize, bound=peak if math.isfinite(peak) and peak > 0 else None)]
    if isinstance(data, Const):
        return _integer_step(b, node, [data, idx], "take", data.array.dtype,
                             lambda d, i: np.take(d, i, axis=axis), data.array.dtype.kind == "b",
                             axis=axis)  # fmt: skip
    raise LoweringError(f"{describe_node(node)}: gathers from {_kind(data)}")


@register_lowering("ArgMax", "ArgMin")
def _arg_extreme(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """The index of the largest / smallest element: of integer ids (CLIP's text pooling at the
    EOS token, ``input_ids.argmax(-1)``), or of a quantized tensor's codes, which for a
    positive scale are in the order of its real values (equal codes: equal values)."""
    v = ins[0]
    a = attrs_of(node)
    attrs = {"fn": node.op_type, "axis": int(a.get("axis", 0)),
             "keepdims": bool(a.get("keepdims", 1)), "last": bool(a.get("select_last_index", 0))}  # fmt: skip
    if isinstance(v, QValue) and v.tensor.scale > 0:
        source = v.tensor
    elif isinstance(v, IntInput | IndexValue | Const):
        operand = _operand(b, node, v)
        if isinstance(operand, Const):
            return [Const(KERNELS["arg_extreme"](attrs, operand.array))]
        source = operand.tensor
    else:
        raise LoweringError(
            f"{describe_node(node)}: reads {_kind(v)}; lowered on integer ids or on a quantized "
            "tensor (DequantizeLinear -> ArgMax): quantize its input (for logits, a "
            "QuantizeLinear after the last layer: quantize_outputs=True)"
        )
    out = b.tensor(node.output[0], np.int64, 1.0, 0)
    b.step("arg_extreme", node_name(node), [source], out, **attrs)
    return [IndexValue(out, False)]


def integer_concat(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """Concat of integer tensors (CLIP: ``[arange(B), argmax(ids)]`` index pairs), called by the
    Concat lowering when an operand is an integer tensor of the model."""
    vs = [_operand(b, node, v) for v in ins]
    dtype = np.result_type(*(_dtype(v) for v in vs))
    axis = int(attrs_of(node)["axis"])
    return _integer_step(b, node, vs, "int_concat", dtype,
                         lambda *xs: np.concatenate(xs, axis=axis).astype(dtype),
                         dtype == np.dtype(bool), axis=axis, dtype=held(dtype))  # fmt: skip


@register_lowering("GatherND")
def _gather_nd(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """Constant indices: data movement (``_movement``). Run-time indices (CLIP's pooling at the
    EOS token: ``hidden[arange(B), argmax(ids)]``): a ``take_nd`` step on the codes."""
    data, indices = ins[0], ins[1]
    if attrs_of(node).get("batch_dims", 0):
        raise LoweringError(f"{describe_node(node)}: batch_dims > 0 is not lowered")
    if isinstance(indices, Const):
        return [moved(b, node, data, "gather_nd", {"indices": _const_indices(node, indices)})]
    idx = _tensor(b, node, _operand(b, node, indices))
    name = node_name(node)
    if isinstance(data, Pending):  # a final LayerNorm's output: requantized, then gathered
        inner = data

        def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
            before = builder.like(out.name + "_before_take_nd", out)
            inner.realize(builder, before, qmin, qmax)
            builder.step("take_nd", name, [before, idx], out)

        return [Pending(data.node, realize, data.lo, data.hi, data.bound)]
    if not isinstance(data, QValue | IndexValue):
        raise LoweringError(f"{describe_node(node)}: gathers from {_kind(data)} by run-time "
                            "indices; only quantized codes or integer tensors are lowered")  # fmt: skip
    out = b.like(node.output[0], data.tensor)
    b.step("take_nd", name, [data.tensor, idx], out)
    return [QValue(out, data.integer) if isinstance(data, QValue)
            else IndexValue(out, data.logical)]  # fmt: skip
