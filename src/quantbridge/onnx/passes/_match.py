"""Matching a node's quantized operands: a DequantizeLinear in front of an input, a QuantizeLinear
behind the output (possibly through a Relu / Clip that the QuantizeLinear makes redundant).

Case 13 of the fold (``__init__``) lives here: an activation between the op and its output
QuantizeLinear is absorbed when it is *exact* to drop it, i.e. ``Q(act(x)) == Q(x)`` for every
``x``. ``Q`` is monotone, so for ``act = clip(., lo, hi)`` this holds iff ``Q(lo) == qmin`` and
``Q(hi) == qmax`` (a Relu is ``lo = 0``, ``hi = +inf``; ``Q(0) = zero_point``, so a Relu is
absorbed iff the zero point is ``qmin``). ``Q(lo)`` is computed by ``numerics.quantize``, the
same formula ONNX QuantizeLinear applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...numerics import quantize
from ._graph import GraphView, QParams, attribute

_ABSORBABLE = frozenset({"Relu", "Clip"})


@dataclass(frozen=True)
class QInput:
    """An input read through a DequantizeLinear: the integer tensor and its parameters."""

    tensor: str
    params: QParams
    dequantize: onnx.NodeProto


# the integer operators (QLinearConv, QGemm, QLinearAdd ...) take 8-bit codes only: int16 and
# int4 tensors (ORT's A16W8 / int4 QDQ, also in the com.microsoft domain) stay in QDQ form
EIGHT_BIT = frozenset({TensorProto.INT8, TensorProto.UINT8})


@dataclass(frozen=True)
class QOutput:
    """The QuantizeLinear that quantizes a node's output, and the absorbed activation if any."""

    quantize: onnx.NodeProto
    params: QParams
    activation: onnx.NodeProto | None

    @property
    def tensor(self) -> str:
        return self.quantize.output[0]

    @property
    def nodes(self) -> list[onnx.NodeProto]:
        return [self.quantize] + ([self.activation] if self.activation is not None else [])


def q_input(g: GraphView, tensor: str, per_tensor: bool = True) -> QInput | None:
    dq = g.produced_by(tensor, "DequantizeLinear")
    if dq is None:
        return None
    params = g.qparams(dq)
    if params is None or (per_tensor and not params.per_tensor) or params.dtype not in EIGHT_BIT:
        return None
    return QInput(dq.input[0], params, dq)


def q_output(g: GraphView, node: onnx.NodeProto) -> QOutput | None:
    """The per-tensor QuantizeLinear that is the only reader of ``node``'s (single) output."""
    if len([t for t in node.output if t]) != 1:
        return None
    user = g.sole_consumer(node.output[0])
    activation = None
    if user is not None and user.op_type in _ABSORBABLE:
        activation, user = user, g.sole_consumer(user.output[0])
    if user is None or user.op_type != "QuantizeLinear" or user.input[0] == "":
        return None
    params = g.qparams(user)
    if params is None or not params.per_tensor or params.dtype not in EIGHT_BIT:
        return None
    if activation is not None and not absorbed(g, activation, params):
        return None
    return QOutput(user, params, activation)


def operands(g: GraphView, *params: QParams) -> tuple[list[tuple[str, str]], list]:
    """(scale, zero point) name pairs for QOperator inputs, and the constants it had to make:
    missing zero points, and scalars for per-tensor parameters stored with shape [1] (older
    exporters write them; QuantizeLinear takes them, ONNX Runtime's QLinearAdd, QLinearMul, ...
    refuse them: "Scale and Zero-point must be a scalar")."""
    pairs, inits = [], []
    for p in params:
        p, new = g.with_zero_point(p)
        inits += new
        names = [p.scale, p.zero_point]
        if p.per_tensor:
            values = (p.scale_value, p.zero_point_value)
            names = [g.scalar(n, v, inits) for n, v in zip(names, values, strict=True)]
        pairs.append((names[0], names[1]))
    return pairs, inits


def one_type(*params: QParams) -> bool:
    """The activations of a QOperator share one integer type: ONNX Runtime implements QLinearConv,
    QGemm, QLinearMatMul, QLinearAdd, QLinearConcat, ... for uint8-in/uint8-out and int8-in/int8-out
    only (a model whose input is int8 and whose post-ReLU tensors are uint8 keeps that layer in QDQ
    form)."""
    return len({p.dtype for p in params}) <= 1


def weight_for(g: GraphView, activation: QParams, w: QInput) -> tuple[QInput, list] | None:
    """``w`` in a type ONNX Runtime pairs with ``activation`` in QLinearConv, QLinearMatMul and
    QGemm, and the initializers that takes; None when it cannot be had exactly.

    ONNX Runtime 1.32 registers these for (uint8 activation, uint8 or int8 weight) and (int8
    activation, int8 weight) only: int8 activations with uint8 weights ("Could not find an
    implementation for QLinearConv(10)"; ONNX Runtime's quantize_static with
    ``activation_type=QInt8, weight_type=QUInt8`` writes them) get their weight's codes and zero
    point moved down by 128. That is exact: ``w - z == (w - 128) - (z - 128)`` and both stay in
    int8. A per-channel uint8 weight would need zero points -128 (QLinearConv takes per-channel
    zero points 0, or one value for every channel) unless every zero point is 128 (symmetric
    uint8: they become 0), and a uint8 *activation* as second operand is not a constant to
    shift: both decline (the op stays QDQ, ``quantbridge fold`` lists it as not folded).

    With uint8 activations a uint8 weight stays uint8, per tensor or per channel (zero points
    then 128, the one per-channel form ``_weight`` passes): (uint8, uint8) is registered and its
    products are exact on every CPU, while (uint8, int8) is summed pairwise in int16 with
    saturation on x86 without VNNI (``quantbridge._platform``): moving full-range uint8 weights
    to int8 there changed ORT's per-channel u8u8 MiniLM-style file by 56 output steps."""
    if w.params.dtype != TensorProto.UINT8 or activation.dtype != TensorProto.INT8:
        return w, []  # (uint8, uint8), (int8|uint8, int8): registered
    stored = g.array(w.tensor)
    symmetric = np.all(np.asarray(w.params.zero_point_value) == 128)
    if stored is None or not (w.params.per_tensor or symmetric):
        return None
    p = w.params
    codes = g.constant(w.tensor + "_int8", (stored.astype(np.int16) - 128).astype(np.int8))
    zero = (np.asarray(p.zero_point_value).astype(np.int16) - 128).astype(np.int8)
    zp = g.constant(w.tensor + "_zero_point_int8", zero)
    params = QParams(p.scale, zp.name, p.scale_value, zero, p.axis, TensorProto.INT8)
    return QInput(codes.name, params, w.dequantize), [codes, zp]


def type_range(dtype: int) -> tuple[int, int]:
    info = np.iinfo(helper.tensor_dtype_to_np_dtype(dtype))
    return int(info.min), int(info.max)


def clip_bounds(g: GraphView, clip: onnx.NodeProto) -> tuple[float | None, float | None] | None:
    """A Relu's or Clip's (lo, hi), None where unbounded; None if a bound is not a constant."""
    if clip.op_type == "Relu":
        return 0.0, None
    bounds: list[float | None] = []
    for index, name in ((1, "min"), (2, "max")):
        if len(clip.input) > index and clip.input[index]:
            value = g.array(clip.input[index])
            if value is None:
                return None
            bounds.append(float(value))
        else:
            bounds.append(attribute(clip, name))
    return bounds[0], bounds[1]


# Case 13
def absorbed(g: GraphView, activation: onnx.NodeProto, params: QParams) -> bool:
    """Case 13: is ``Q(activation(x)) == Q(x)`` for every x? (module docstring)"""
    bounds = clip_bounds(g, activation)
    if bounds is None:
        return False
    qmin, qmax = type_range(params.dtype)
    for bound, edge in zip(bounds, (qmin, qmax), strict=True):
        if bound is None:
            continue
        code = quantize(np.float32(bound), params.scale_value, params.zero_point_value, qmin, qmax)
        if float(np.asarray(code).ravel()[0]) != edge:
            return False
    return True
