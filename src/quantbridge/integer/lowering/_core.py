"""What lowering works on: symbolic values of ONNX tensors, the program builder, the registry.

Lowering interprets the QDQ graph symbolically. Each ONNX tensor becomes one of:

* ``Const``       a float or integer initializer (shapes, Clip bounds, constants);
* ``FloatInput``  a float graph input, waiting for its QuantizeLinear;
* ``IntInput``    an integer graph input (codes), waiting for its DequantizeLinear or QLinear op;
* ``QConst``      an integer initializer with its (scale, zero point, axis): weights, biases;
* ``QValue``      a program tensor of codes (``QTensor``); ``integer`` says the ONNX tensor is
                  the codes themselves (a QuantizeLinear output), not their dequantized floats;
* ``Pending``     a float result of an integer kernel (Conv, Add, AveragePool, ...) that needs
                  the output (scale, zero point) of the QuantizeLinear that will consume it;
                  Relu / Clip in between narrow its clamp; ops that commute with quantization
                  (data movement, MaxPool) are applied after the requantization;
* ``Elementwise`` a float function of one 8-bit program tensor (Sigmoid, x * sigmoid(x), ...):
                  at its QuantizeLinear it becomes an exact 256-entry table;
* ``IndexValue``  an integer or bool tensor of the model's own, not codes of a real value (an
                  attention mask, position ids, token ids): integer steps on it are exact
                  (``_index``); bools are held as uint8 0 / 1 (``logical``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx

from ...numerics import quantize
from .._program import Boundary, QTensor, Step


class LoweringError(ValueError):
    """The model cannot be lowered to an integer-only program; the message says why and how."""


@dataclasses.dataclass(frozen=True)
class Const:
    array: np.ndarray


@dataclasses.dataclass(frozen=True)
class FloatInput:
    name: str


@dataclasses.dataclass(frozen=True)
class IntInput:
    name: str
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class QConst:
    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int | None


@dataclasses.dataclass(frozen=True)
class QValue:
    tensor: QTensor
    integer: bool = False
    # a bound on sum |q - z| along the last axis when one is known (softmax probabilities:
    # 2**15 + K/2), tighter than K * max|q - z| for the accumulator of a MatMul reading it
    row_sum: int | None = None
    # a softmax of scores masked with -inf: its keep mask. A row with none kept is 0 / 0 = NaN
    # in float (ONNX Runtime), uniform in the program; IsNaN reads those rows off it (_nonfinite)
    nan_keep: QTensor | None = None


Realize = Callable[["Builder", QTensor, int, int], None]


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """A weighted layer's accumulator as it stands before requantization: ``real[c] = scale[c]
    * acc[c]`` along ``axis`` of the output (1: Conv, -1: MatMul / Gemm), ``|acc| <= bound``.
    ``write(builder, out, qmin, qmax)`` adds the layer's step with the identity requantization
    (multiplier 1, shift 0, zero point 0), so ``out`` holds the accumulator codes themselves
    (a float graph output written by the layer, ``_outputs``)."""

    scale: np.ndarray
    axis: int
    bound: float
    write: Realize


@dataclasses.dataclass(frozen=True)
class Pending:
    """``realize(builder, out, qmin, qmax)`` adds the steps that write ``out``. ``bound``: a
    bound on ``|real value|`` where the op gives one (layer norm), so that a float graph output
    can be realized on a grid the lowering picks (``_outputs``). ``accumulator``: set on a
    weighted layer's result (and kept through a Relu / Clip after it)."""

    node: str
    realize: Realize
    lo: float = -math.inf
    hi: float = math.inf
    bound: float | None = None
    accumulator: Accumulator | None = None


@dataclasses.dataclass(frozen=True)
class Elementwise:
    source: QTensor
    fn: Callable[[np.ndarray], np.ndarray]
    node: str


@dataclasses.dataclass(frozen=True)
class IndexValue:
    tensor: QTensor  # scale 1, zero point 0: the integers themselves
    logical: bool = False  # an ONNX bool tensor, held as uint8 0 / 1


@dataclasses.dataclass(frozen=True)
class MaskedScores:
    """``Where(mask, -inf, scores)`` (or ``Where(keep, scores, -inf)``) waiting for its Softmax:
    ``keep`` (uint8 0 / 1, broadcast to the scores) says which scores stay; the others have
    weight exactly 0 (``kernels._normalize.softmax``)."""

    scores: Value
    keep: QTensor
    node: str
    nan_rows: bool = False  # the fill is -inf: a row with none kept is NaN in float
    fill: float = -math.inf  # the value where not kept (a Q of Where(keep, 0, fill) reads it)


Value = (Const | FloatInput | IntInput | QConst | QValue | Pending | Elementwise | IndexValue
         | MaskedScores)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SumPending(Pending):
    """An Add / Sub of two tensors before its QuantizeLinear; ``bound`` bounds ``|real|`` (a
    Softmax reading it directly, Swin's scores plus a relative position bias, picks its int16
    grid from it: ``_normalize``; so do a LayerNormalization and a float graph output)."""


def node_name(node: onnx.NodeProto) -> str:
    return node.name or (node.output[0] if node.output else node.op_type)


def attrs_of(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def describe_node(node: onnx.NodeProto) -> str:
    return f"{node.op_type} {node_name(node)!r}"


def accumulator_multiplier_bits(bound: float) -> int:
    """Multiplier bits that keep ``bound * M < 2**62`` (``numerics.requantize``'s contract)."""
    return max(1, min(31, 61 - math.ceil(math.log2(bound + 1))))


def quantize_real(r: float, t: QTensor) -> int:
    """``r`` quantized to ``t``'s grid, saturated (ONNX QuantizeLinear in float64)."""
    q = quantize(np.float64(r), np.float64(t.scale), np.float64(t.zero_point), t.qmin, t.qmax)
    return int(q)


class Builder:
    """Accumulates the program while the handlers lower nodes."""

    def __init__(self, accumulator_bits: int, shapes: dict[str, tuple[int | None, ...]]):
        self.accumulator_bits = accumulator_bits
        self.shapes = shapes
        self.steps: list[Step] = []
        self.tensors: dict[str, QTensor] = {}
        self.constants: dict[str, np.ndarray] = {}
        self.inputs: list[Boundary] = []
        self.overflows: list[str] = []
        self.onnx_tensors: dict[str, str] = {}
        self.readers: dict[str, int] = {}  # ONNX tensor -> nodes reading it (+1: graph output)
        self.opset = 21  # the model's default-domain opset (``lower`` sets it)
        self.index_inputs: dict[str, Any] = {}  # integer graph input -> its IndexValue
        self.realized: dict[str, QTensor] = {}  # a pending value realized for a float function
        self.ours = False  # the file is quantbridge's own export (``_quantbridge.`` initializers)

    def dim(self, name: str, axis: int) -> int | None:
        """A static dimension of ONNX tensor ``name`` (shape inference), or None."""
        shape = self.shapes.get(name)
        if shape is None or not -len(shape) <= axis < len(shape):
            return None
        return shape[axis]

    def tensor(self, base: str, dtype: Any, scale: float, zero_point: int) -> QTensor:
        name, k = base, 1
        while name in self.tensors:
            name, k = f"{base}_{k}", k + 1
        t = QTensor(name, np.dtype(dtype), float(scale), int(zero_point))
        self.tensors[name] = t
        return t

    def like(self, base: str, t: QTensor) -> QTensor:
        return self.tensor(base, t.dtype, t.scale, t.zero_point)

    def step(self, op: str, node: str, inputs: list[QTensor], out: QTensor, **attrs: Any) -> None:
        self.steps.append(Step(op, node, tuple(i.name for i in inputs), out.name, attrs))

    def constant(self, base: str, q: np.ndarray, scale: float, zero_point: int) -> QTensor:
        t = self.tensor(base, q.dtype, scale, zero_point)
        self.constants[t.name] = q
        return t

    def check_accumulator(self, node: str, bound: float) -> int:
        """Record ``node`` when its accumulator bound exceeds the accumulator; the multiplier
        bits that keep the requantization product inside int64."""
        limit = 2 ** (self.accumulator_bits - 1) - 1
        if bound > limit:
            self.overflows.append(
                f"{node}: |accumulator| can reach {int(bound)} > {limit} "
                f"(int{self.accumulator_bits})"
            )
        return accumulator_multiplier_bits(bound)


# a bounded float result that no QuantizeLinear follows is realized on symmetric int16 codes:
# 2**-15 of its bound is far below the 8-bit steps of every quantized tensor before it, and int16
# keeps the C and integer-ONNX types the program already uses
BOUNDED_BITS = 16


def realize_bounded(b: Builder, name: str, v: Pending) -> QTensor:
    """``v`` (``v.bound`` set) realized on a symmetric int16 grid of step ``reach / 32767``,
    ``reach`` its bound narrowed by a Relu / Clip after it: half a step of error per element."""
    top = 2 ** (BOUNDED_BITS - 1) - 1
    reach = min(v.bound, max(abs(v.lo), abs(v.hi)))
    out = b.tensor(name, np.int16, (reach if reach > 0 else 1.0) / top, 0)
    lo = -top if v.lo == -math.inf else max(-top, int(np.rint(v.lo / out.scale)))
    hi = top if v.hi == math.inf else min(top, int(np.rint(v.hi / out.scale)))
    v.realize(b, out, lo, max(lo, hi))
    return out


def held(dtype: np.dtype) -> np.dtype:
    """The program dtype of an ONNX integer / bool dtype: bools are uint8 0 / 1."""
    return np.dtype(np.uint8) if np.dtype(dtype) == bool else np.dtype(dtype)


def index_input(b: Builder, v: IntInput) -> IndexValue:
    """The integer graph input ``v`` as a program input (once, however many ops read it)."""
    if v.name not in b.index_inputs:
        t = b.tensor(v.name, held(v.dtype), 1.0, 0)
        b.inputs.append(Boundary(v.name, t, False))
        b.index_inputs[v.name] = IndexValue(t, np.dtype(v.dtype) == bool)
    return b.index_inputs[v.name]


Handler = Callable[[Builder, onnx.NodeProto, list[Value | None]], list[Value]]
LOWERINGS: dict[str, Handler] = {}


def register_lowering(*op_types: str) -> Callable[[Handler], Handler]:
    """Register a handler for ONNX op types: ``handler(builder, node, input values) -> outputs``."""

    def add(fn: Handler) -> Handler:
        for op in op_types:
            if op in LOWERINGS:
                raise ValueError(f"lowering for {op!r} registered twice")
            LOWERINGS[op] = fn
        return fn

    return add


def code_range(t: QTensor, zero: object) -> int:
    """``max |q - z|`` over ``t``'s codes."""
    z = np.asarray(zero, np.int64)
    return int(max(np.max(t.qmax - z), np.max(z - t.qmin)))


def as_activation(node: onnx.NodeProto, v: Value | None, what: str = "input") -> QTensor:
    if isinstance(v, QValue):
        return v.tensor
    raise LoweringError(
        f"{describe_node(node)}: its {what} is {_kind(v)}, not a quantized tensor; "
        "the QDQ pattern is DequantizeLinear -> op -> QuantizeLinear"
    )


def as_qconst(node: onnx.NodeProto, v: Value | None, what: str) -> QConst:
    if isinstance(v, QConst):
        return v
    unquantized = isinstance(v, Const) and v.array.dtype.kind == "f"
    raise LoweringError(
        f"{describe_node(node)}: {what} is {_kind(v)}; expected an integer initializer "
        "followed by DequantizeLinear"
        + (
            ". The layer was left in float: quantize it too (qb.quantize_onnx / `quantbridge "
            "quantize` keep the layers of a Sigmoid/Softmax head in float unless "
            "float_head=False / --int8-head)"
            if unquantized
            else ""
        )
    )


def as_const(node: onnx.NodeProto, v: Value | None, what: str) -> np.ndarray:
    if isinstance(v, Const):
        return v.array
    raise LoweringError(f"{describe_node(node)}: {what} must be a constant, got {_kind(v)}")


def _kind(v: Value | None) -> str:
    """What ``v`` is, in words (a subclass, ``LinearPending`` or ``SumPending``, as its base)."""
    kinds = {
        type(None): "missing",
        Const: "a constant",
        FloatInput: "an unquantized graph input",
        IntInput: "an integer graph input",
        QConst: "an integer constant",
        QValue: "a quantized tensor",
        Pending: "an unquantized float result (no QuantizeLinear after it)",
        Elementwise: "an unquantized float function (no QuantizeLinear after it)",
        IndexValue: "an integer / bool tensor computed in the program (a mask, indices)",
        MaskedScores: "masked float scores (Where(mask, -inf, scores)), lowered only as the "
        "input of a Softmax",
    }
    return next((kinds[c] for c in type(v).__mro__ if c in kinds), f"a {type(v).__name__}")


def as_function(v: Value | None) -> tuple[QTensor | None, Callable] | None:
    """``(source, f)`` when ``v`` is ``f(source)`` (source None: a scalar constant)."""
    if isinstance(v, QValue) and not v.integer:
        return v.tensor, lambda r: r
    if isinstance(v, Elementwise):
        return v.source, v.fn
    if isinstance(v, Const) and np.size(v.array) == 1 and v.array.dtype.kind == "f":
        c = np.float64(np.asarray(v.array).reshape(()))
        return None, lambda r: c
    return None


def compose(node: onnx.NodeProto, operands: list[Value | None], combine) -> Elementwise | None:
    """``combine`` of operands that are all functions of one 8-bit tensor (or scalar float
    constants): the composed ``Elementwise`` (a table at its QuantizeLinear), else None."""
    parts = [as_function(v) for v in operands]
    if any(p is None for p in parts):
        return None
    sources = {p[0].name: p[0] for p in parts if p[0] is not None}
    if len(sources) != 1:
        return None
    fns = [p[1] for p in parts]
    return Elementwise(next(iter(sources.values())), lambda r: combine(*(f(r) for f in fns)),
                       node_name(node))  # fmt: skip
