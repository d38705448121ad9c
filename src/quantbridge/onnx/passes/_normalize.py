"""Cases 1-3 of the fold (``__init__``): move DequantizeLinear down and QuantizeLinear up through
ops that only move or select values, and cancel DequantizeLinear -> QuantizeLinear pairs that
share their parameters. Afterwards data movement runs on the integer tensors and every compute op
reads its inputs straight from a DequantizeLinear and writes straight into a QuantizeLinear.

Why it is exact: with a per-tensor positive scale, ``DQ(q) = s (q - z)`` is strictly increasing
and acts elementwise, so it commutes with every op in ``INTEGER_DATA_MOVEMENT`` (they copy or
select elements; MaxPool takes a maximum, and its padding is the type's minimum either way);
``Q`` is non-decreasing and elementwise, so ``Q(M(x)) == M(Q(x))`` for the same ops; and
``Q(DQ(q)) == q`` for the same parameters (``round(q - z) + z = q``, inside the range).

Case 3c (``_clip_constant_codes``): a Clip of integer constant codes with constant bounds is
the clipped constant (exact: it is evaluated once, on the integers the file holds).

Case 3b (``_quantize_before_activation``): ``op -> Relu/Clip -> Q`` where Q does not absorb the
activation (``_match.absorbed``: a signed grid after a Relu, as NVIDIA ModelOpt writes) becomes
``op -> Q -> DQ -> Relu/Clip -> Q`` with the output Q's parameters, so that ``op -> Q`` folds
(QLinearConv, QGemm ...) and ``DQ -> Relu/Clip -> Q`` folds to a Clip on the codes (case 14).
Exact: Q is non-decreasing, so ``Q(clip(x, a, b)) == clip(Q(x), Q(a), Q(b))``, and
``Q(clip(DQ(Q(x)), a, b)) == clip(Q(DQ(Q(x))), Q(a), Q(b)) == clip(Q(x), Q(a), Q(b))``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ._graph import GraphView, Rewrite, attribute, attributes, node
from ._match import EIGHT_BIT, absorbed, clip_bounds
from ._registry import fold_handler

# ops that commute with a per-tensor affine (de)quantization: they copy, select or take maxima.
# Data is input 0; the other inputs are shapes, axes, indices, sizes.
INTEGER_DATA_MOVEMENT = frozenset(
    {
        "MaxPool",
        "Reshape",
        "Flatten",
        "Transpose",
        "Squeeze",
        "Unsqueeze",
        "Slice",
        "Resize",
        "Identity",
    }
)

# ... on 8-bit codes only: ONNX's MaxPool takes int8 / uint8 (no int16: ORT's A16W8 files)
EIGHT_BIT_MOVEMENT = frozenset({"MaxPool", "Resize"})
# 4-bit codes move through none of them: ONNX Runtime 1.32 registers no int4 / uint4 kernel for
# Identity, Reshape, Transpose ... ("Type 'tensor(int4)' of input parameter ... of operator
# (Identity) ... is invalid"); they stay behind their DequantizeLinear
FOUR_BIT = frozenset({TensorProto.INT4, TensorProto.UINT4})


def _codes_move(mover: onnx.NodeProto, params) -> bool:
    if params.dtype in FOUR_BIT:
        return False
    return mover.op_type not in EIGHT_BIT_MOVEMENT or params.dtype in EIGHT_BIT


def _moves_data(g: GraphView, n: onnx.NodeProto) -> bool:
    if n.op_type not in INTEGER_DATA_MOVEMENT or len([t for t in n.output if t]) != 1:
        return False
    if n.op_type == "MaxPool" and g.opset < 12:  # integer MaxPool needs opset 12
        return False
    if n.op_type == "Resize" and attribute(n, "mode", b"nearest") not in (b"nearest", "nearest"):
        return False
    # the non-data inputs must not be quantized activations themselves
    return not any(g.produced_by(t, "DequantizeLinear") for t in n.input[1:] if t)


# Case 1
def _sink_dequantize(g: GraphView, mover: onnx.NodeProto) -> Rewrite | None:
    """Case 1: ``DQ -> M`` becomes ``M -> DQ``; M then moves integers. A per-channel DQ over a
    stored weight sinks below a Transpose by transposing the stored integers."""
    dq = g.produced_by(mover.input[0], "DequantizeLinear")
    if dq is None or not _moves_data(g, mover):
        return None
    params = g.qparams(dq)
    if params is None or not _codes_move(mover, params):
        return None
    if not params.per_tensor:
        return _transpose_weight(g, dq, mover, params.axis)
    moved = g.fresh(mover.output[0] + "_int")
    new_mover = onnx.NodeProto.FromString(mover.SerializeToString())
    new_mover.input[0], new_mover.output[0] = dq.input[0], moved
    new_dq = node(
        "DequantizeLinear", [moved, *dq.input[1:]], [mover.output[0]], g.fresh(dq.name or "dq")
    )
    return Rewrite(remove=[mover], add=[new_mover, new_dq])


def _transpose_weight(g: GraphView, dq: onnx.NodeProto, mover: onnx.NodeProto, axis: int):
    stored = g.array(dq.input[0])
    if mover.op_type != "Transpose" or stored is None:
        return None
    perm = attribute(mover, "perm") or list(range(stored.ndim))[::-1]
    weight = numpy_helper.from_array(np.transpose(stored, perm), g.fresh(dq.input[0] + "_t"))
    new_dq = node(
        "DequantizeLinear",
        [weight.name, *dq.input[1:]],
        [mover.output[0]],
        g.fresh(dq.name or "dq"),
        axis=list(perm).index(axis % stored.ndim),
    )
    return Rewrite(remove=[mover], add=[new_dq], initializers=[weight])


# Case 2
def _raise_quantize(g: GraphView, q: onnx.NodeProto) -> Rewrite | None:
    """Case 2: ``M -> Q`` becomes ``Q -> M`` (per-tensor Q; M's input is not a DQ output)."""
    mover = g.producer.get(q.input[0])
    if mover is None or not _moves_data(g, mover) or g.sole_consumer(mover.output[0]) is not q:
        return None
    params = g.qparams(q)
    if params is None or not params.per_tensor or not _codes_move(mover, params):
        return None
    if g.produced_by(mover.input[0], "DequantizeLinear") is not None:
        return None  # Case 1 sinks that DQ instead
    quantized = g.fresh(mover.input[0] + "_q")
    new_q = node(
        "QuantizeLinear",
        [mover.input[0], *q.input[1:]],
        [quantized],
        g.fresh(q.name or "q"),
        **attributes(q),
    )
    new_mover = onnx.NodeProto.FromString(mover.SerializeToString())
    new_mover.input[0], new_mover.output[0] = quantized, q.output[0]
    return Rewrite(remove=[mover, q], add=[new_q, new_mover])


# Case 3
def _cancel_pair(g: GraphView, q: onnx.NodeProto) -> Rewrite | None:
    """Case 3: ``DQ -> Q`` with equal parameters is the identity; readers of Q read DQ's input.

    When DQ's input is a tensor the fold made (case 1's integer MaxPool / Reshape output), that
    tensor takes the Q's name instead: the file's quantized tensor names survive the fold, and
    ``compare`` pairs the folded file's tensors with the QDQ file's by them."""
    dq = g.produced_by(q.input[0], "DequantizeLinear")
    if dq is None or q.output[0] in g.outputs:
        return None
    dq_params, q_params = g.qparams(dq), g.qparams(q)
    if dq_params is None or q_params is None or not dq_params.same_as(q_params):
        return None
    old, new = dq.input[0], q.output[0]
    made = old not in g.file_names and old in g.producer and old not in g.outputs
    if not made:
        old, new = new, dq.input[0]  # readers of Q read DQ's input
    remove, add = [q], []
    touched = [g.producer[old]] if made else []
    readers = {id(n): n for n in g.consumers.get(old, []) if n is not q}  # once each
    touched += list(readers.values())
    for n in touched:
        renamed = onnx.NodeProto.FromString(n.SerializeToString())
        for names in (renamed.input, renamed.output):
            for i, t in enumerate(names):
                if t == old:
                    names[i] = new
        remove.append(n)
        add.append(renamed)
    return Rewrite(remove=remove, add=add)


# Case 3b
def _quantize_before_activation(g: GraphView, q: onnx.NodeProto) -> Rewrite | None:
    """Case 3b: ``op -> Relu/Clip -> Q`` (Q not absorbing it) becomes
    ``op -> Q -> DQ -> Relu/Clip -> Q`` (module docstring)."""
    act = g.producer.get(q.input[0])
    if act is None or act.op_type not in ("Relu", "Clip") or g.opset < 12:
        return None
    if g.sole_consumer(act.output[0]) is not q or clip_bounds(g, act) is None:
        return None
    op = g.producer.get(act.input[0])
    if op is None or op.op_type in _QDQ or fold_handler(op.op_type) is None:
        return None
    if g.sole_consumer(act.input[0]) is not act or act.input[0] in g.outputs:
        return None
    params = g.qparams(q)
    if params is None or not params.per_tensor or absorbed(g, act, params):
        return None
    codes, value = g.fresh(act.input[0] + "_q"), g.fresh(act.input[0] + "_dq")
    new_q = node("QuantizeLinear", [act.input[0], *q.input[1:]], [codes], g.fresh("q"),
                 **attributes(q))  # fmt: skip
    new_dq = node("DequantizeLinear", [codes, *q.input[1:]], [value], g.fresh("dq"),
                  **attributes(q))  # fmt: skip
    new_act = onnx.NodeProto.FromString(act.SerializeToString())
    new_act.input[0] = value
    return Rewrite(remove=[act], add=[new_q, new_dq, new_act])


# Case 3c
def _clip_constant_codes(g: GraphView, clip: onnx.NodeProto) -> Rewrite | None:
    """Case 3c: ``integer constant -> Clip(constant bounds)`` (Brevitas's QCDQ weights:
    ``int8 codes -> Clip(-7, 7) -> DQ``) becomes the clipped constant, named as Clip's output."""
    init = g.initializers.get(clip.input[0]) if clip.input else None
    if init is None or clip.output[0] in g.outputs or g.opset < 11:
        return None
    codes = numpy_helper.to_array(init)
    names = [*clip.input[1:3], "", ""][:2]
    if codes.dtype.kind not in "iu" or any(t and t not in g.initializers for t in names):
        return None
    lo, hi = (numpy_helper.to_array(g.initializers[t]) if t else None for t in names)
    clipped = codes.clip(lo, hi) if lo is not None or hi is not None else codes
    init = numpy_helper.from_array(clipped.astype(codes.dtype), clip.output[0])
    return Rewrite(remove=[clip], add=[], initializers=[init])


_QDQ = ("QuantizeLinear", "DequantizeLinear")


def _first_rewrite(g: GraphView) -> Rewrite | None:
    for n in g.nodes:
        rewrite = None
        if n.op_type == "QuantizeLinear":
            rewrite = (
                _cancel_pair(g, n) or _raise_quantize(g, n) or _quantize_before_activation(g, n)
            )
        elif n.op_type in INTEGER_DATA_MOVEMENT and n.input:
            rewrite = _sink_dequantize(g, n)
        elif n.op_type == "Clip":
            rewrite = _clip_constant_codes(g, n)
        if rewrite is not None:
            return rewrite
    return None


def normalize(g: GraphView) -> tuple[GraphView, bool]:
    """Apply cases 1-3 until none applies; returns the new view and whether anything changed."""
    changed = False
    for _ in range(10 * len(g.nodes) + 10):  # every rewrite moves a Q/DQ or removes a Q
        rewrite = _first_rewrite(g)
        if rewrite is None:
            return g, changed
        g, changed = g.apply(rewrite), True
    raise AssertionError("fold: Q/DQ normalisation did not converge")
