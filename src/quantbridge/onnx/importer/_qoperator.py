"""QOperator ops unfolded into float ops and ``Site`` nodes (Case 6 of ``_quantized``).

Each rule reads the op's integer operands as their dequantized float values (``Normaliser.read``:
a constant becomes a float constant recorded with its integers; a run-time tensor is checked to
be read on the grid it was written on), emits the float op of the same attributes, and quantizes
the result onto the op's output grid with a ``Site``. Operand positions are those of the ONNX
(``QLinearConv``, ``QLinearMatMul``) and ONNX Runtime contrib (``com.microsoft``) schemas; an
int32 bias is dequantized with ``input scale x weight scale`` (the scale the kernels use).

Integer semantics: ONNX Runtime computes these ops with integer accumulation and one float
requantization (``round(acc * x_scale * w_scale / y_scale) + y_zero_point``), or in float on the
dequantized values and a lookup table (Sigmoid, LeakyRelu, Softmax); the float op followed by the
output quantizer computes the same value up to float rounding at a requantization tie.
"""

from __future__ import annotations

import onnx

from ...optables import QOPERATOR_FLOAT_OPS
from ._quantized import Normaliser, rule

_UNARY = {op: QOPERATOR_FLOAT_OPS[op] for op in ("QLinearSigmoid", "QLinearLeakyRelu",
          "QLinearSoftmax", "QLinearAveragePool", "QLinearGlobalAveragePool")}  # fmt: skip
_BINARY = {op: QOPERATOR_FLOAT_OPS[op] for op in ("QLinearAdd", "QLinearMul")}
_DROPPED_ATTRS = {"channels_last", "opset"}


def _output(ctx: Normaliser, node: onnx.NodeProto, op: str, inputs, s: int, z: int | None, **attrs):
    """``op(inputs) -> raw``, then ``Site(raw) -> node.output[0]`` on the grid of inputs s / z."""
    y = node.output[0]
    qp = ctx.qparams(node, y, s, z)
    if qp.axis is not None:
        raise ValueError(f"{ctx.where(node)}: a per-channel output scale is not supported")
    raw = f"{y}_qb_float"
    ctx.emit(op, inputs, [raw], name=node.name, **attrs)
    ctx.site(raw, y, qp, y)


def _operand(ctx: Normaliser, node: onnx.NodeProto, x: int, s: int, z: int, axis=None) -> str:
    name = node.input[x]
    return ctx.read(node, name, ctx.qparams(node, name, s, z, axis))


def _float_attrs(ctx: Normaliser, node: onnx.NodeProto) -> dict:
    return {k: v for k, v in ctx.attrs(node).items() if k not in _DROPPED_ATTRS}


CHANNELS_LAST_FIX = (
    "channels_last=1 is ONNX Runtime's NHWC layout (ORT_ENABLE_ALL's layout transformation, "
    "saved through SessionOptions.optimized_model_filepath); import the QDQ file it was made "
    "from, or save the optimized model at ORT_ENABLE_EXTENDED"
)


@rule("QLinearConv")
def _qlinear_conv(ctx: Normaliser, node: onnx.NodeProto) -> None:
    if ctx.attrs(node).get("channels_last", 0):
        raise ValueError(f"{ctx.where(node)}: {CHANNELS_LAST_FIX}")
    x = _operand(ctx, node, 0, 1, 2)
    w = _operand(ctx, node, 3, 4, 5, axis=0)
    inputs = [x, w]
    if len(node.input) > 8 and node.input[8]:
        scale = ctx.const(node.input[1]) * ctx.const(node.input[4])  # float32 product
        inputs.append(ctx.dequantize_bias(node, node.input[8], scale))
    _output(ctx, node, "Conv", inputs, 6, 7, **ctx.attrs(node))


@rule("QLinearMatMul")
def _qlinear_matmul(ctx: Normaliser, node: onnx.NodeProto) -> None:
    a = _operand(ctx, node, 0, 1, 2)
    b = _operand(ctx, node, 3, 4, 5, axis=-1)  # per column of B: the output channels
    _output(ctx, node, "MatMul", [a, b], 6, 7)


@rule("QGemm")
def _qgemm(ctx: Normaliser, node: onnx.NodeProto) -> None:
    attrs = ctx.attrs(node)
    if attrs.get("alpha", 1.0) != 1.0:
        raise ValueError(f"{ctx.where(node)}: alpha={attrs['alpha']} is not supported (only 1)")
    a = _operand(ctx, node, 0, 1, 2)
    b = _operand(ctx, node, 3, 4, 5, axis=0 if attrs.get("transB", 0) else 1)
    inputs = [a, b]
    if len(node.input) > 6 and node.input[6]:
        scale = ctx.const(node.input[1]) * ctx.const(node.input[4])
        inputs.append(ctx.dequantize_bias(node, node.input[6], scale))
    gemm = {k: v for k, v in attrs.items() if k in ("transA", "transB", "alpha")}
    if len(node.input) > 7 and node.input[7]:
        _output(ctx, node, "Gemm", inputs, 7, 8 if len(node.input) > 8 else None, **gemm)
    else:  # no output scale: a float output
        ctx.emit("Gemm", inputs, [node.output[0]], name=node.name, **gemm)


@rule(*_BINARY)
def _qlinear_binary(ctx: Normaliser, node: onnx.NodeProto) -> None:
    a = _operand(ctx, node, 0, 1, 2)
    b = _operand(ctx, node, 3, 4, 5)
    _output(ctx, node, _BINARY[node.op_type], [a, b], 6, 7)


@rule(*_UNARY)
def _qlinear_unary(ctx: Normaliser, node: onnx.NodeProto) -> None:
    attrs = ctx.attrs(node)
    if attrs.get("channels_last", 0):
        raise ValueError(f"{ctx.where(node)}: channels_last=1 is not supported")
    if node.op_type == "QLinearSoftmax":
        return _qlinear_softmax(ctx, node, attrs)
    x = _operand(ctx, node, 0, 1, 2)
    _output(ctx, node, _UNARY[node.op_type], [x], 3, 4, **_float_attrs(ctx, node))


def _qlinear_softmax(ctx: Normaliser, node: onnx.NodeProto, attrs: dict) -> None:
    """QLinearSoftmax's ``opset`` attribute gives its Softmax semantics, not the model's (ONNX
    Runtime's qlinear_softmax.cc): below 13 the input is flattened to 2-D at ``axis`` (softmax
    over all dimensions from ``axis`` on), from 13 ``axis`` is one dimension. A missing ``axis``
    is -1 at every opset: the contrib schema's default fills it before the kernel's opset-12
    default of 1 is reached (measured, ORT 1.32: ORT's quantizer writes an opset-12 Softmax as
    QLinearSoftmax(opset=12) with no axis, and ORT computes it over the last axis, not as the
    float model does). Opset-12 semantics at another axis in an opset >= 13 model are written
    ``Flatten(axis) -> Softmax(-1) -> Reshape(Shape(x))``, their definition."""
    semantics = int(attrs.get("opset", ctx.opset))
    axis = int(attrs.get("axis", -1))
    if semantics >= 13 > ctx.opset and axis != -1:
        raise ValueError(
            f"{ctx.where(node)}: opset-{semantics} Softmax semantics (one axis, {axis}) in an "
            f"opset-{ctx.opset} model; re-export the model at opset >= 13"
        )
    x = _operand(ctx, node, 0, 1, 2)
    if axis == -1 or (semantics < 13) == (ctx.opset < 13):
        _output(ctx, node, "Softmax", [x], 3, 4, axis=axis)
        return
    flat, soft, shape = (f"{node.output[0]}_qb_{k}" for k in ("flat", "softmax", "shape"))
    ctx.emit("Flatten", [x], [flat], name=f"{node.name}/flatten", axis=axis)
    ctx.emit("Softmax", [flat], [soft], name=f"{node.name}/softmax", axis=-1)
    ctx.emit("Shape", [x], [shape], name=f"{node.name}/shape")
    _output(ctx, node, "Reshape", [soft, shape], 3, 4)


@rule("QLinearConcat")
def _qlinear_concat(ctx: Normaliser, node: onnx.NodeProto) -> None:
    inputs = [_operand(ctx, node, i, i + 1, i + 2) for i in range(2, len(node.input), 3)]
    _output(ctx, node, "Concat", inputs, 0, 1, axis=ctx.attrs(node)["axis"])
