"""Dynamic quantization unfolded into float ops (Case 7 of ``_quantized``).

ONNX Runtime's ``quantize_dynamic`` writes, per weighted op::

    DynamicQuantizeLinear(x) -> (y uint8, y_scale, y_zero_point)
    Mul(y_scale, w_scale) -> s                       # the rescale factor
    ConvInteger / MatMulInteger(y, w int8, y_zero_point, w_zero_point) -> acc int32
    Cast(acc, float) -> a;  Mul(a, s) -> out         # out = acc * y_scale * w_scale

or the fused contrib ops ``MatMulIntegerToFloat(y, w, y_scale, w_scale, y_zp, w_zp, bias)`` and
``DynamicQuantizeMatMul(x, w, w_scale, w_zp, bias)``. Since
``acc * y_scale * w_scale = conv(dequantize(y), dequantize(w))`` up to float rounding, each group
becomes ``DynamicSite(x) -> y`` (the per-call fake quantization) and one float ``Conv`` / ``MatMul``
on ``y`` and the dequantized weight (recorded with its integers, so the layer gets a weight
quantizer with the file's scales), writing ``out`` directly; the Cast and the two Muls are
absorbed. A group of another shape is refused.
"""

from __future__ import annotations

import onnx

from ._quantized import SITE_DOMAIN, Normaliser, rule

_FLOAT_OPS = {"ConvInteger": "Conv", "MatMulInteger": "MatMul"}


@rule("DynamicQuantizeLinear")
def _dynamic_quantize_linear(ctx: Normaliser, node: onnx.NodeProto) -> None:
    x, (y, scale, zero_point) = node.input[0], node.output
    ctx.emit("DynamicSite", [x], [y], name=node.name, domain=SITE_DOMAIN)
    ctx.dynamic[y] = (scale, zero_point)


def _single_user(ctx: Normaliser, name: str, op_type: str) -> onnx.NodeProto | None:
    users = ctx.users.get(name, [])
    return users[0] if len(users) == 1 and users[0].op_type == op_type else None


def _rescale(
    ctx: Normaliser, node: onnx.NodeProto, y_scale: str | None
) -> tuple[onnx.NodeProto, str, str]:
    """The ``Cast -> Mul(., y_scale * w_scale)`` after an integer op: (the Mul, w_scale's name,
    y_scale's name). ``y_scale=None``: operand ``y`` is a gathered integer table (Case 5b), its
    scale the factor's first input (ONNX Runtime writes ``Mul(input scale, weight scale)``; the
    product, all the output depends on, is the same either way)."""
    cast = _single_user(ctx, node.output[0], "Cast")
    mul = _single_user(ctx, cast.output[0], "Mul") if cast is not None else None
    factor = None
    if mul is not None:
        other = mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0]
        factor = ctx.producer.get(other)
    if y_scale is None and factor is not None and factor.op_type == "Mul":
        y_scale = factor.input[0]
    if factor is None or factor.op_type != "Mul" or y_scale not in factor.input:
        raise ValueError(
            f"{ctx.where(node)}: its int32 result must be rescaled by Cast -> Mul(., y_scale * "
            "w_scale) as ONNX Runtime's quantize_dynamic writes it; this graph does otherwise"
        )
    w_scale = factor.input[1] if factor.input[0] == y_scale else factor.input[0]
    ctx.absorbed.update([cast.output[0], mul.output[0]])
    if ctx.readers.get(factor.output[0], 0) == 1:  # written before: taken out again
        ctx.absorbed.add(factor.output[0])
        ctx.nodes = [n for n in ctx.nodes if n is not factor]
    return mul, w_scale, y_scale


def _dynamic_operand(ctx: Normaliser, node: onnx.NodeProto, y: str, zero_point: str) -> str:
    if y not in ctx.dynamic or (zero_point and zero_point != ctx.dynamic[y][1]):
        raise ValueError(
            f"{ctx.where(node)}: operand {y!r} must come from a DynamicQuantizeLinear and be read "
            "with its zero point"
        )
    return y


@rule("ConvInteger", "MatMulInteger")
def _integer_op(ctx: Normaliser, node: onnx.NodeProto) -> None:
    inputs = list(node.input) + [""] * (4 - len(node.input))
    if inputs[0] in ctx.pending or ctx.grid(inputs[0]) is not None:
        # rows of an integer table (Case 5b) read on its own grid, whether this op is its first
        # reader or a DequantizeLinear before it was (ONNX Runtime's quantized embedding feeding
        # both the model and a MatMulInteger)
        mul, w_scale, y_scale = _rescale(ctx, node, None)
        y = ctx.read(node, inputs[0], ctx.qparams_named(node, inputs[0], y_scale, inputs[2]))
    else:
        y = _dynamic_operand(ctx, node, inputs[0], inputs[2])
        mul, w_scale, _ = _rescale(ctx, node, ctx.dynamic[y][0])
    w_zero = len(node.input) > 3 and node.input[3]
    holder = onnx.helper.make_node(
        "W", ["", w_scale, inputs[3] if w_zero else ""], [], name=node.name
    )
    qp = ctx.qparams(holder, inputs[1], 1, 2 if w_zero else None,
                     axis=0 if node.op_type == "ConvInteger" else -1)  # fmt: skip
    w = ctx.read(node, inputs[1], qp)
    attrs = ctx.attrs(node)
    ctx.emit(_FLOAT_OPS[node.op_type], [y, w], [mul.output[0]], name=node.name, **attrs)


@rule("MatMulIntegerToFloat")
def _matmul_integer_to_float(ctx: Normaliser, node: onnx.NodeProto) -> None:
    inputs = list(node.input) + [""] * (7 - len(node.input))
    y = _dynamic_operand(ctx, node, inputs[0], inputs[4])
    if inputs[2] != ctx.dynamic[y][0]:
        raise ValueError(f"{ctx.where(node)}: a_scale must be the DynamicQuantizeLinear's scale")
    qp = ctx.qparams(node, inputs[1], 3, 5 if inputs[5] else None, axis=-1)
    _matmul_plus_bias(ctx, node, y, ctx.read(node, inputs[1], qp), inputs[6])


@rule("DynamicQuantizeMatMul")
def _dynamic_quantize_matmul(ctx: Normaliser, node: onnx.NodeProto) -> None:
    inputs = list(node.input) + [""] * (5 - len(node.input))
    y = f"{node.output[0]}_dynamic_input"
    ctx.emit("DynamicSite", [inputs[0]], [y], name=f"{node.name}_input", domain=SITE_DOMAIN)
    qp = ctx.qparams(node, inputs[1], 2, 3 if inputs[3] else None, axis=-1)
    _matmul_plus_bias(ctx, node, y, ctx.read(node, inputs[1], qp), inputs[4])


def _matmul_plus_bias(ctx: Normaliser, node: onnx.NodeProto, y: str, w: str, bias: str) -> None:
    out = node.output[0]
    if not bias:
        ctx.emit("MatMul", [y, w], [out], name=node.name)
        return
    ctx.emit("MatMul", [y, w], [f"{out}_qb_matmul"], name=node.name)
    ctx.emit("Add", [f"{out}_qb_matmul", bias], [out], name=f"{node.name}_bias")
