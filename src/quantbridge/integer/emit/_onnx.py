"""Integer-only ONNX for an ``IntegerProgram``: only integer tensors between the boundaries.

``to_onnx(program, input_shapes)`` builds a ModelProto whose inputs and outputs are the
program's integer codes and whose nodes are ConvInteger / MatMulInteger (int32 sums), int64
Mul / Add / Sub, Div / Less / BitwiseAnd (the flooring, ties-to-even shift), Clip, Cast, Gather
(tables, index maps), MaxPool, ReduceSum, ReduceMax / ReduceMin and data movement. One
generator per kernel op (``ONNX_STEPS``). The requantization is ``numerics.requantize`` written out in int64:

    p  = acc * M'                    (M' = M * 2**-n where n <= 0: a left shift folded in)
    fl = floor(p / D)                (D = 2**max(n, 0); floor from truncating Div: q - (p < q D))
    r  = floor((p + D/2 - 1 + (fl & 1)) / D)        (ties to even; D = 1 leaves p unchanged)
    y  = Cast(Clip(r + z, lo, hi))

An output that is a weighted layer's int32 accumulator (``lower(..., float_outputs=
"dequantize")``) is output as those int32 codes; its float scale (``Boundary.scale``) is applied
outside the model, as a table tail's table is.

ConvInteger / MatMulInteger run u8 x u8 (int8 operands shifted by 128 with their zero points):
ONNX Runtime's u8 x s8 kernels on x86 without VNNI saturate pairs of products in int16
(measured on the digits model: 58 of 4500 MatMulInteger sums wrong, 9 output codes off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..kernels import KERNELS
from ..kernels._movement import INDEX_MAPPED, resize_indices

I64 = TensorProto.INT64


class _Graph:
    def __init__(self, program: Any, shapes: dict[str, tuple[int, ...]]):
        self.program, self.shapes = program, shapes
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.k = 0

    def name(self, base: str) -> str:
        self.k += 1
        return f"{base}__{self.k}"

    def const(self, value: Any, dtype: Any = np.int64) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: Any) -> str:
        out = out or self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def i64(self, x: str) -> str:
        return self.op("Cast", [x], to=I64)

    def centered(self, x: str, zero: int) -> str:
        return self.op("Sub", [self.i64(x), self.const(zero)])

    def as_u8(self, x: str, dtype: Any, zero: Any) -> tuple[str, str]:
        """``(codes, zero point)`` as uint8 (int8 codes + 128, zero point + 128: the same
        differences ``q - z``). ORT's u8s8 ConvInteger / MatMulInteger kernels on x86 without
        VNNI sum u8 * s8 pairs in saturating int16 (VPMADDUBSW) and lose exactness; u8u8 does
        not."""
        if np.dtype(dtype) == np.uint8:
            return x, self.const(zero, np.uint8)
        if np.dtype(dtype) != np.int8:
            raise ValueError(f"ONNX emitter: {np.dtype(dtype)} operands have no integer kernel")
        wide = self.op(
            "Add", [self.op("Cast", [x], to=TensorProto.INT16), self.const(128, np.int16)]
        )
        shifted = np.asarray(zero, np.int64) + 128
        return self.op("Cast", [wide], to=TensorProto.UINT8), self.const(shifted, np.uint8)

    def weight_u8(self, w: np.ndarray, zero: Any) -> tuple[str, str]:
        if w.dtype == np.uint8:
            return self.const(w, np.uint8), self.const(zero, np.uint8)
        return (self.const(w.astype(np.int16) + 128, np.uint8),
                self.const(np.asarray(zero, np.int64) + 128, np.uint8))  # fmt: skip

    def floor_div(self, a: str, d: str) -> str:
        q = self.op("Div", [a, d])  # int64 Div truncates toward zero
        below = self.op("Less", [a, self.op("Mul", [q, d])])
        return self.op("Sub", [q, self.i64(below)])

    def requantize(self, acc: str, step, multiplier, shift, shape, out: str) -> str:
        a = step.attrs
        m = np.broadcast_to(np.asarray(multiplier, np.int64), shape)
        n = np.broadcast_to(np.asarray(shift, np.int64), shape)
        m_left = m * np.left_shift(np.int64(1), np.maximum(-n, 0))
        d = np.left_shift(np.int64(1), np.maximum(n, 0))
        p = self.op("Mul", [acc, self.const(m_left)])
        dc = self.const(d)
        fl = self.floor_div(p, dc)
        odd = self.op("BitwiseAnd", [fl, self.const((d > 1).astype(np.int64))])
        half = self.const(np.maximum(d // 2 - 1, 0))
        r = self.floor_div(self.op("Add", [self.op("Add", [p, half]), odd]), dc)
        r = self.op("Add", [r, self.const(a["out_zero"])])
        r = self.op("Clip", [r, self.const(a["qmin"]), self.const(a["qmax"])])
        to = helper.np_dtype_to_tensor_dtype(np.dtype(a["dtype"]))
        return self.op("Cast", [r], out, to=to)


def _channel_shape(rank: int, axis: int, size: int) -> tuple[int, ...]:
    shape = [1] * rank
    shape[axis] = size
    return tuple(shape)


def _scalar_zero(step, zeros, what: str) -> int:
    z = np.unique(np.asarray(zeros))
    if z.size != 1:
        raise ValueError(f"ONNX emitter: {step.node!r}: per-channel {what} zero points differ")
    return int(z[0])


StepGen = Callable[[_Graph, Any, list[str], str], None]
ONNX_STEPS: dict[str, StepGen] = {}


def _register(*ops: str) -> Callable[[StepGen], StepGen]:
    def add(fn: StepGen) -> StepGen:
        for op in ops:
            ONNX_STEPS[op] = fn
        return fn

    return add


def _x_u8(g: _Graph, step, x: str, zero: int, i: int = 0) -> tuple[str, str]:
    return g.as_u8(x, g.program.tensors[step.inputs[i]].dtype, zero)


@_register("conv")
def _conv(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    w = np.asarray(a["weight"])
    wz = _scalar_zero(step, a["w_zero"], "weight")
    spatial = w.ndim - 2
    wu, wzu = g.weight_u8(w, wz)

    def sums(x: str, xz: str) -> str:
        return g.i64(g.op("ConvInteger", [x, wu, xz, wzu], group=a["group"],
                          strides=list(a["strides"]), pads=list(a["pads"]),
                          dilations=list(a["dilations"]), kernel_shape=list(w.shape[2:])))  # fmt: skip

    if np.dtype(g.program.tensors[step.inputs[0]].dtype).itemsize == 1:
        acc = sums(*_x_u8(g, step, ins[0], a["x_zero"]))
    else:  # int16 codes (EfficientFormerV2's talking head reads softmax probabilities)
        acc = _int16_sums(g, step, ins[0], a["x_zero"], sums)
    shape = _channel_shape(spatial + 2, 1, w.shape[0])
    acc = g.op("Add", [acc, g.const(np.asarray(a["bias"]).reshape(shape))])
    g.requantize(acc, step, np.reshape(a["multiplier"], shape), np.reshape(a["shift"], shape),
                 shape, out)  # fmt: skip


@_register("conv_transpose")
def _conv_transpose(g: _Graph, step, ins: list[str], out: str) -> None:
    """A transposed convolution as a ConvInteger over the input with ``stride - 1`` zero-point
    codes inserted between elements (they are 0 once centered) and ``d (k - 1) - pad`` border,
    with the weight transposed per group and flipped."""
    a = step.attrs
    n, c, h, w = g.shapes[step.inputs[0]]
    weight = np.asarray(a["weight"])
    group, (sh, sw), (dh, dw) = a["group"], a["strides"], a["dilations"]
    og, kh, kw = weight.shape[1:]
    wz = _scalar_zero(step, a["w_zero"], "weight")
    x, z = _x_u8(g, step, ins[0], a["x_zero"])
    if (sh, sw) != (1, 1):
        x = g.op("Unsqueeze", [x, g.const([3, 5])])
        x = g.op("Pad", [x, g.const([0, 0, 0, 0, 0, 0, 0, 0, 0, sh - 1, 0, sw - 1]), z])
        x = g.op("Reshape", [x, g.const([n, c, h * sh, w * sw])])
        x = g.op("Slice", [x, g.const([0, 0]), g.const([(h - 1) * sh + 1, (w - 1) * sw + 1]),
                           g.const([2, 3])])  # fmt: skip
    pads, extra = a["pads"], a["output_padding"]
    border = [dh * (kh - 1) - pads[0], dw * (kw - 1) - pads[1],
              dh * (kh - 1) - pads[2] + extra[0], dw * (kw - 1) - pads[3] + extra[1]]  # fmt: skip
    x = g.op("Pad", [x, g.const([0, 0, border[0], border[1], 0, 0, border[2], border[3]]), z])
    grouped = weight.reshape(group, c // group, og, kh, kw).transpose(0, 2, 1, 3, 4)
    flipped = grouped[..., ::-1, ::-1].reshape(group * og, c // group, kh, kw)
    wu, wzu = g.weight_u8(np.ascontiguousarray(flipped), wz)
    acc = g.op("ConvInteger", [x, wu, z, wzu],
               group=group, dilations=[dh, dw], kernel_shape=[kh, kw])  # fmt: skip
    shape = _channel_shape(4, 1, group * og)
    acc = g.op("Add", [g.i64(acc), g.const(np.asarray(a["bias"]).reshape(shape))])
    g.requantize(acc, step, np.reshape(a["multiplier"], shape), np.reshape(a["shift"], shape),
                 shape, out)  # fmt: skip


@_register("matmul")
def _matmul(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    if any(np.dtype(g.program.tensors[t].dtype).itemsize > 1 for t in step.inputs) or (
        len(ins) == 1 and np.asarray(a["weight"]).dtype.itemsize > 1
    ):  # 16-bit codes, or int16 weight codes (a float weight on int16 codes: ``_linear``)
        return _matmul_wide(g, step, ins, out)
    x, az = _x_u8(g, step, ins[0], a["a_zero"])
    if len(ins) == 1:
        w, bz = g.weight_u8(np.asarray(a["weight"]), np.asarray(a["b_zero"]))
    else:
        w, bz = _x_u8(g, step, ins[1], a["b_zero"], 1)
    acc = g.op("MatMulInteger", [x, w, az, bz])
    cols = g.shapes[step.output][-1]
    acc = g.op("Add", [g.i64(acc), g.const(np.broadcast_to(a["bias"], (cols,)))])
    g.requantize(acc, step, a["multiplier"], a["shift"], (cols,), out)


def _matmul_wide(g: _Graph, step, ins: list[str], out: str) -> None:
    """16-bit codes (softmax probabilities, int16 activations): centered int64 MatMul (exact:
    the lowering bounded the sums below the accumulator)."""
    a = step.attrs
    if len(ins) == 1:
        w = np.asarray(a["weight"]).astype(np.int64) - np.asarray(a["b_zero"], np.int64)
        b = g.const(w)
    else:
        b = g.centered(ins[1], int(a["b_zero"]))
    acc = g.op("MatMul", [g.centered(ins[0], a["a_zero"]), b])
    cols = g.shapes[step.output][-1]
    acc = g.op("Add", [acc, g.const(np.broadcast_to(a["bias"], (cols,)))])
    g.requantize(acc, step, a["multiplier"], a["shift"], (cols,), out)


@_register("rescale_sum")
def _rescale_sum(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    terms = [g.op("Mul", [g.centered(x, z), g.const(m)])
             for x, z, m in zip(ins, a["zeros"], a["multipliers"], strict=True)]  # fmt: skip
    acc = terms[0]
    for t in terms[1:]:
        acc = g.op("Add", [acc, t])
    g.requantize(acc, step, 1, a["shift"], (), out)


@_register("mul")
def _mul(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    za, zb = a["zeros"]
    acc = g.op("Mul", [g.centered(ins[0], za), g.centered(ins[1], zb)])
    g.requantize(acc, step, a["multiplier"], a["shift"], (), out)


@_register("concat")
def _concat(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    parts = [g.requantize(g.centered(x, z), step, m, n, (), g.name("part"))
             for x, z, m, n in zip(ins, a["zeros"], a["multipliers"], a["shifts"], strict=True)]  # fmt: skip
    g.op("Concat", parts, out, axis=a["axis"])


@_register("lut")
def _lut(g: _Graph, step, ins: list[str], out: str) -> None:
    table = np.asarray(step.attrs["table"])
    index = g.centered(ins[0], step.attrs["in_qmin"])
    g.op("Gather", [g.const(table, table.dtype), index], out, axis=0)


@_register("maxpool")
def _maxpool(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    g.op("MaxPool", ins, out, kernel_shape=list(a["kernel"]), strides=list(a["strides"]),
         pads=list(a["pads"]), dilations=list(a["dilations"]))  # fmt: skip


@_register("reduce_max", "reduce_min")
def _reduce_extreme(g: _Graph, step, ins: list[str], out: str) -> None:
    """ReduceMax / ReduceMin on the codes widened to int32 (ONNX Runtime has no 8-bit kernel
    in every build), cast back: the same codes."""
    a = step.attrs
    axes = [] if a["axes"] is None else [g.const(list(a["axes"]))]
    op = "ReduceMax" if step.op == "reduce_max" else "ReduceMin"
    wide = g.op("Cast", [ins[0]], to=TensorProto.INT32)
    y = g.op(op, [wide, *axes], keepdims=int(a["keepdims"]))
    to = helper.np_dtype_to_tensor_dtype(np.dtype(g.program.tensors[step.output].dtype))
    g.op("Cast", [y], out, to=to)


@_register("avgpool")
def _avgpool(g: _Graph, step, ins: list[str], out: str) -> None:
    """Window sums as a depthwise ConvInteger with unit weights (padding adds x_zero: 0)."""
    a = step.attrs
    channels = g.shapes[step.inputs[0]][1]
    ones = g.const(np.ones((channels, 1, *a["kernel"]), np.uint8), np.uint8)

    def sums(x: str, xz: str) -> str:
        return g.i64(g.op("ConvInteger", [x, ones, xz, g.const(0, np.uint8)], group=channels,
                          strides=list(a["strides"]), pads=list(a["pads"]),
                          dilations=list(a["dilations"]), kernel_shape=list(a["kernel"])))  # fmt: skip

    if np.dtype(g.program.tensors[step.inputs[0]].dtype).itemsize == 1:
        acc = sums(*_x_u8(g, step, ins[0], a["x_zero"]))
    else:
        acc = _int16_sums(g, step, ins[0], a["x_zero"], sums)
    shape = g.shapes[step.output][2:]
    g.requantize(acc, step, a["multiplier"], a["shift"], shape, out)


def _int16_sums(g: _Graph, step, x: str, zero: int, sums: Callable[[str, str], str]) -> str:
    """A linear window sum (``sums(u8 codes, u8 zero point)``, int64) of int16 codes: ``c = q -
    z = 256 hi + lo``, lo in [0, 255], hi in [-128, 127] (so ``|q - z| <= 32768``); two exact
    8-bit sums. The padding of both is their zero point: 0 once centered, as for ``c``."""
    t = g.program.tensors[step.inputs[0]]
    if not (-32768 <= t.qmin - zero and t.qmax - zero <= 32767):
        raise ValueError(f"ONNX emitter: {step.node}: int16 codes minus {zero} leave 16 bits")
    c = g.centered(x, zero)
    lo = g.op("BitwiseAnd", [c, g.const(255)])
    hi = g.op("Add", [g.op("Div", [g.op("Sub", [c, lo]), g.const(256)]), g.const(128)])
    u8 = TensorProto.UINT8
    return g.op("Add", [sums(g.op("Cast", [lo], to=u8), g.const(0, np.uint8)),
                        g.op("Mul", [sums(g.op("Cast", [hi], to=u8), g.const(128, np.uint8)),
                                     g.const(256)])])  # fmt: skip


@_register("reduce_mean")
def _reduce_mean(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    acc = g.op("ReduceSum", [g.centered(ins[0], a["x_zero"]), g.const(list(a["axes"]))],
               keepdims=int(a["keepdims"]))  # fmt: skip
    g.requantize(acc, step, a["multiplier"], a["shift"], (), out)


@_register("reshape")
def _reshape(g: _Graph, step, ins: list[str], out: str) -> None:
    g.op("Reshape", [ins[0], g.const(list(g.shapes[step.output]))], out)


@_register("flatten", "squeeze", "unsqueeze", "identity")
def _to_shape(g: _Graph, step, ins: list[str], out: str) -> None:
    _reshape(g, step, ins, out)


@_register("transpose")
def _transpose(g: _Graph, step, ins: list[str], out: str) -> None:
    perm = step.attrs["perm"] or tuple(reversed(range(len(g.shapes[step.inputs[0]]))))
    g.op("Transpose", ins, out, perm=list(perm))


@_register("slice", "resize_nearest", "gather", *INDEX_MAPPED)
def _gather(g: _Graph, step, ins: list[str], out: str) -> None:
    """A gather through the flat index map the numpy kernel computes on ``arange``."""
    shape = g.shapes[step.inputs[0]]
    if step.op == "resize_nearest":
        x = ins[0]
        for axis, index in resize_indices(step.attrs, shape).items():
            x = g.op("Gather", [x, g.const(index)], axis=axis)
        g.op("Identity", [x], out)
        return
    index = KERNELS[step.op](step.attrs, np.arange(int(np.prod(shape))).reshape(shape))
    flat = g.op("Reshape", [ins[0], g.const([-1])])
    g.op("Gather", [flat, g.const(index)], out, axis=0)


@_register("pad")
def _pad(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    dtype = np.dtype(g.program.tensors[step.inputs[0]].dtype)
    constant = [g.const(a["value"], dtype)] if a["mode"] == "constant" else []
    g.op("Pad", [ins[0], g.const(list(a["pads"])), *constant], out, mode=a["mode"])


def to_onnx(program: Any, input_shapes=None) -> onnx.ModelProto:
    """The program as an integer-only ONNX model (inputs and outputs: integer codes)."""
    shapes = program.tensor_shapes(input_shapes)
    g = _Graph(program, shapes)
    for name, q in program.constants.items():
        g.inits.append(numpy_helper.from_array(np.asarray(q), name))
    for step in program.steps:
        gen = ONNX_STEPS.get(step.op)
        if gen is None:
            raise ValueError(
                f"ONNX emitter: no ONNX for step {step.op!r}; known: {sorted(ONNX_STEPS)}"
            )
        if step.op in ("conv", "conv_transpose", "matmul") and step.attrs["bound"] >= 2**31:
            raise ValueError(
                f"ONNX emitter: {step.node!r} needs more than ConvInteger's int32 sums"
            )
        gen(g, step, list(step.inputs), step.output)

    def info(b: Any) -> onnx.ValueInfoProto:
        dtype = helper.np_dtype_to_tensor_dtype(np.dtype(b.tensor.dtype))
        return helper.make_tensor_value_info(b.tensor.name, dtype, list(shapes[b.tensor.name]))

    graph = helper.make_graph(g.nodes, "quantbridge_integer_program",
                              [info(b) for b in program.inputs],
                              [info(b) for b in program.outputs], g.inits)  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)],
                              producer_name="quantbridge.lower")  # fmt: skip
    model.ir_version = 10
    return model
