"""``UnfoldQOperator``: ONNX Runtime's contrib QOperator ops (domain com.microsoft) rewritten to
the canonical QDQ form, ``DequantizeLinear(operands) -> float op -> QuantizeLinear``, each op's
definition in ONNX Runtime's contrib schema. The inverse of ``FoldQOperator``'s cases 5 and 8-12;
``lower`` runs it first, so one lowering (of the QDQ patterns) serves both forms.

Rewrite cases (each labelled ``# Case n`` below):

1. ``QLinearAdd`` / ``QLinearMul`` -> ``DQ(a), DQ(b) -> Add / Mul -> Q``.
2. ``QLinearSigmoid`` / ``QLinearLeakyRelu`` / ``QLinearSoftmax`` / ``QLinearAveragePool`` /
   ``QLinearGlobalAveragePool`` -> ``DQ -> op (same attributes) -> Q``; ``channels_last=1`` is
   refused; QLinearSoftmax's ``opset`` attribute must give the model's Softmax semantics unless
   ``axis`` is -1 (or missing: the schema's default), where both semantics agree.
3. ``QLinearConcat`` -> ``DQ(x_i) -> Concat -> Q``.
4. ``QGemm`` -> ``DQ(A), DQ(B) [per column], DQ(C: int32, scale A_scale x B_scale) -> Gemm
   [-> Q]`` (no ``y_scale``: a float output); ``alpha`` must be 1.
5. ``QLinearReduceMean`` -> ``DQ -> ReduceMean -> Q`` (``axes`` an input from opset 18).
6. ``QLinearWhere`` -> ``Where(condition, DQ(x), DQ(y)) -> Q``.

QLinearConv and QLinearMatMul (standard ONNX ops, which ``lower`` reads directly) and other
contrib ops stay as they are (``PassResult.modified`` False when nothing matched); the caller
names what it cannot read. The float op keeps the QOperator node's name; the DQ/Q nodes are named
after it (``NAME/dq0``, ``NAME/q``), the new tensors after its output (``Y/qb_dq0``...).

Numerics. The unfolded graph computes each op's definition exactly (real operands, real op,
ONNX QuantizeLinear: round half to even, saturate). ONNX Runtime's CPU kernels compute the same
definition in float32 (contrib_ops/cpu/quantization and MLAS, read for ORT 1.32): QLinearAdd
``rne(fma(a, sa/sc, fma(b, sb/sc, zc - (sa/sc za + sb/sc zb))))`` (qladd_avx2.cpp), QLinearMul
``rne((a-za)(b-zb) * (sa sb / sc) + zc)`` (qlmul.cpp), QLinearGlobalAveragePool
``rne((sum - N zx) * sx / (sy N)) + zy`` (qlgavgpool.cpp), QLinearAveragePool the float pool of
the dequantized values, QLinearSigmoid / LeakyRelu / Concat (other scales) a 256-entry table of
``MlasQuantizeLinear(f(sx (i - zx)))`` with MlasComputeLogistic's float32 sigmoid, QGemm one
float32 requantization of the int32 accumulator, QLinearSoftmax a float exp table times
``floor(1 / y_scale)`` (the definition for ORT's scale 1/256). Each differs from the exact value
by float32 rounding (a few 1e-6 of an output step), so ONNX Runtime and the definition disagree
by one output step only where the exact value lies within that of a rounding tie
(``tests/integer/test_integer_qoperator.py`` makes such ties and measures them).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...optables import QOPERATOR_FLOAT_OPS
from ._fold import PassResult
from ._graph import MS_DOMAIN, attributes, label

Unfold = Callable[["_Context", onnx.NodeProto], list[onnx.NodeProto]]
UNFOLDS: dict[str, Unfold] = {}


def register_unfold(*ops: str) -> Callable[[Unfold], Unfold]:
    def deco(fn: Unfold) -> Unfold:
        for op in ops:
            UNFOLDS[op] = fn
        return fn

    return deco


def unfoldable_ops() -> frozenset[str]:
    return frozenset(UNFOLDS)


class _Context:
    """What the handlers read (constants, element types, the opset) and the initializers they
    add; one per pass call."""

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        self.tensors = {i.name: i for i in g.initializer}  # read (to numpy) only when asked
        for n in g.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                self.tensors[n.output[0]] = n.attribute[0].t
        self.dtypes: dict[str, int] = {i.name: i.data_type for i in g.initializer}
        for vi in [*g.input, *g.value_info, *g.output]:
            if vi.type.tensor_type.elem_type:
                self.dtypes[vi.name] = vi.type.tensor_type.elem_type
        self.new_inits: list[onnx.TensorProto] = []

    def const(self, node: onnx.NodeProto, name: str, what: str) -> np.ndarray:
        if name not in self.tensors:
            raise ValueError(f"{label(node)}: {what} {name!r} must be a constant (an initializer)")
        return numpy_helper.to_array(self.tensors[name])

    def add_const(self, name: str, array: np.ndarray) -> str:
        tensor = numpy_helper.from_array(np.asarray(array), name)
        self.new_inits.append(tensor)
        self.tensors[name] = tensor
        return name

    def code_type(self, node: onnx.NodeProto, zero_points: list[str]) -> int:
        """The element type of the node's integer tensors: a zero point's, else its input's."""
        for z in zero_points:
            if z and z in self.dtypes:
                return self.dtypes[z]
        if node.input[0] in self.dtypes:
            return self.dtypes[node.input[0]]
        raise ValueError(f"{label(node)}: no zero point and no known input type; give its zero "
                         "points as initializers")  # fmt: skip

    def learn(self, node: onnx.NodeProto) -> None:
        """Element types of a node's outputs that the handlers may need later (run in order)."""
        out = node.output[0] if node.output else ""
        if not out or out in self.dtypes:
            return
        if node.op_type == "QuantizeLinear":
            z = node.input[2] if len(node.input) > 2 else ""
            self.dtypes[out] = self.dtypes.get(z, onnx.TensorProto.UINT8)
        elif node.op_type != "DequantizeLinear" and node.input and node.input[0] in self.dtypes:
            self.dtypes[out] = self.dtypes[node.input[0]]


def _arg(node: onnx.NodeProto, i: int) -> str:
    return node.input[i] if len(node.input) > i else ""


def _dq(ctx: _Context, node: onnx.NodeProto, k: int, x: int, s: int, z: int, axis=None):
    """``DequantizeLinear`` of operand ``k`` (inputs x, s, z of ``node``): (node, float name)."""
    name = f"{node.output[0]}/qb_dq{k}"
    ins = [node.input[x], node.input[s]] + ([_arg(node, z)] if _arg(node, z) else [])
    attrs = {} if axis is None else {"axis": axis}
    return helper.make_node(
        "DequantizeLinear", ins, [name], name=f"{node.name}/dq{k}", **attrs
    ), name


def _q(ctx: _Context, node: onnx.NodeProto, raw: str, s: int, z: int, code_type: int):
    """``QuantizeLinear(raw) -> node.output[0]`` with the node's output scale and zero point
    (an absent zero point: 0 of the operands' element type, as the contrib kernels read it)."""
    zero = _arg(node, z)
    ctx.dtypes[node.output[0]] = code_type
    if not zero:
        dtype = helper.tensor_dtype_to_np_dtype(code_type)
        zero = ctx.add_const(f"{node.output[0]}/qb_zero_point", np.zeros((), dtype))
    if ctx.const(node, node.input[s], "the output scale").size != 1:
        raise ValueError(f"{label(node)}: a per-channel output scale has no QuantizeLinear form")
    return helper.make_node(
        "QuantizeLinear", [raw, node.input[s], zero], [node.output[0]], name=f"{node.name}/q"
    )


def _unary(ctx, node, float_op: str, ins: list[str], dqs, s: int, z: int, zs, **attrs):
    raw = f"{node.output[0]}/qb_float"
    op = helper.make_node(float_op, ins, [raw], name=node.name, **attrs)
    return [*dqs, op, _q(ctx, node, raw, s, z, ctx.code_type(node, zs))]


def _no_channels_last(node: onnx.NodeProto, attrs: dict) -> dict:
    if attrs.pop("channels_last", 0):
        raise ValueError(f"{label(node)}: channels_last=1 (NHWC) has no ONNX float op; "
                         "quantize the NCHW model instead")  # fmt: skip
    return attrs


@register_unfold("QLinearAdd", "QLinearMul")
def _binary(ctx: _Context, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    # Case 1
    (da, a), (db, b) = _dq(ctx, node, 0, 0, 1, 2), _dq(ctx, node, 1, 3, 4, 5)
    float_op = QOPERATOR_FLOAT_OPS[node.op_type]
    return _unary(ctx, node, float_op, [a, b], [da, db], 6, 7, [_arg(node, 7), _arg(node, 2)])


@register_unfold(
    "QLinearSigmoid", "QLinearLeakyRelu", "QLinearSoftmax", "QLinearAveragePool",
    "QLinearGlobalAveragePool",
)  # fmt: skip
def _one_operand(ctx: _Context, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    # Case 2
    attrs = _no_channels_last(node, attributes(node))
    if node.op_type == "QLinearSoftmax":
        # a missing axis is the contrib schema's -1 at every opset (importer/_qoperator.py)
        semantics = int(attrs.pop("opset", ctx.opset))
        attrs["axis"] = int(attrs.get("axis", -1))
        if attrs["axis"] != -1 and (semantics >= 13) != (ctx.opset >= 13):
            raise ValueError(
                f"{label(node)}: opset-{semantics} Softmax semantics at axis {attrs['axis']} "
                f"in an opset-{ctx.opset} model (the 2-D flattening changed at opset 13); "
                "re-quantize the model with its own opset"
            )
    dx, x = _dq(ctx, node, 0, 0, 1, 2)
    float_op = QOPERATOR_FLOAT_OPS[node.op_type]
    return _unary(ctx, node, float_op, [x], [dx], 3, 4, [_arg(node, 4), _arg(node, 2)], **attrs)


@register_unfold("QLinearConcat")
def _concat(ctx: _Context, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    # Case 3: inputs Y_scale, Y_zero_point, then (X, X_scale, X_zero_point) per operand
    dqs, xs = [], []
    for k, i in enumerate(range(2, len(node.input), 3)):
        d, x = _dq(ctx, node, k, i, i + 1, i + 2)
        dqs.append(d)
        xs.append(x)
    zs = [_arg(node, 1), *(_arg(node, i + 2) for i in range(2, len(node.input), 3))]
    return _unary(ctx, node, "Concat", xs, dqs, 0, 1, zs, **attributes(node))


@register_unfold("QGemm")
def _qgemm(ctx: _Context, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    # Case 4: inputs A, a_scale, a_zp, B, b_scale, b_zp, C (int32), y_scale, y_zp
    attrs = attributes(node)
    if float(attrs.get("alpha", 1.0)) != 1.0:
        raise ValueError(f"{label(node)}: alpha={attrs['alpha']} is not supported (only 1): "
                         "QGemm scales the accumulator, not the bias, by alpha")  # fmt: skip
    attrs.pop("alpha", None)
    a_scale = ctx.const(node, node.input[1], "A_scale").astype(np.float32)
    b_scale = ctx.const(node, node.input[4], "B_scale").astype(np.float32)
    if a_scale.size != 1:
        raise ValueError(f"{label(node)}: A_scale must hold one value, got {a_scale.shape}")
    per_column = b_scale.size > 1 or ctx.const(node, node.input[5], "B_zero_point").size > 1
    axis = (0 if attrs.get("transB", 0) else 1) if per_column else None
    if per_column and ctx.opset < 13:
        raise ValueError(f"{label(node)}: a per-column B in an opset-{ctx.opset} model "
                         "(DequantizeLinear takes an axis from opset 13); convert the model to "
                         "opset 13 (onnx.version_converter) first")  # fmt: skip
    (da, a), (db, b) = _dq(ctx, node, 0, 0, 1, 2), _dq(ctx, node, 1, 3, 4, 5, axis)
    nodes, ins = [da, db], [a, b]
    if _arg(node, 6):
        scale = (a_scale.reshape(()) * b_scale).astype(np.float32)  # the kernel's float32 product
        s = ctx.add_const(f"{node.output[0]}/qb_bias_scale", scale)
        bias = f"{node.output[0]}/qb_bias"
        dq_attrs = {"axis": 0} if scale.size > 1 else {}
        nodes.append(helper.make_node("DequantizeLinear", [node.input[6], s], [bias],
                                      name=f"{node.name}/dq_bias", **dq_attrs))  # fmt: skip
        ins.append(bias)
    if not _arg(node, 7):  # no output scale: the float output itself
        ctx.dtypes[node.output[0]] = onnx.TensorProto.FLOAT
        return [*nodes, helper.make_node("Gemm", ins, [node.output[0]], name=node.name, **attrs)]
    return _unary(ctx, node, "Gemm", ins, nodes, 7, 8, [_arg(node, 8), _arg(node, 2)], **attrs)


@register_unfold("QLinearReduceMean")
def _reduce_mean(ctx: _Context, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    # Case 5: inputs data, data_scale, data_zp, reduced_scale, reduced_zp
    attrs = attributes(node)
    dx, x = _dq(ctx, node, 0, 0, 1, 2)
    ins = [x]
    if ctx.opset >= 18 and "axes" in attrs:
        axes = np.asarray(attrs.pop("axes"), np.int64)
        ins.append(ctx.add_const(f"{node.output[0]}/qb_axes", axes))
    return _unary(ctx, node, "ReduceMean", ins, [dx], 3, 4, [_arg(node, 4), _arg(node, 2)], **attrs)


@register_unfold("QLinearWhere")
def _where(ctx: _Context, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    # Case 6: inputs condition, X, x_scale, x_zp, Y, y_scale, y_zp, z_scale, z_zp
    (dx, x), (dy, y) = _dq(ctx, node, 0, 1, 2, 3), _dq(ctx, node, 1, 4, 5, 6)
    zs = [_arg(node, 8), _arg(node, 3)]
    return _unary(ctx, node, "Where", [node.input[0], x, y], [dx, dy], 7, 8, zs)


class UnfoldQOperator:
    """Contrib QOperator ops -> ``DQ -> float op -> Q`` (see the module docstring's cases).
    Stateless: ``UnfoldQOperator()(model) -> PassResult``."""

    def __call__(self, model: onnx.ModelProto) -> PassResult:
        if not any(n.domain == MS_DOMAIN and n.op_type in UNFOLDS for n in model.graph.node):
            return PassResult(model, False)
        ctx = _Context(model)
        nodes: list[onnx.NodeProto] = []
        modified = False
        for n in model.graph.node:
            handler = UNFOLDS.get(n.op_type) if n.domain == MS_DOMAIN else None
            if handler is None:
                nodes.append(n)
                ctx.learn(n)
                continue
            if not n.name:  # the new nodes are named after it
                n = _named(n, f"{n.op_type}_{len(nodes)}")
            nodes.extend(handler(ctx, n))
            modified = True
        if not modified:
            return PassResult(model, False)
        out = onnx.ModelProto()
        out.CopyFrom(model)
        del out.graph.node[:]
        out.graph.node.extend(nodes)
        out.graph.initializer.extend(ctx.new_inits)
        _set_opset(out)
        return PassResult(out, True)


def _named(node: onnx.NodeProto, name: str) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.name = name
    return copy


def _set_opset(model: onnx.ModelProto) -> None:
    """Q/DQ need opset 10 (per-axis: 13, checked where needed); drop com.microsoft if unused."""
    if not any(n.domain == MS_DOMAIN for n in model.graph.node):
        kept = [o for o in model.opset_import if o.domain != MS_DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx") and o.version < 10:
            raise ValueError(f"an opset-{o.version} model has no QuantizeLinear (opset 10); "
                             "convert it to opset 13 (onnx.version_converter) first")  # fmt: skip


def unfold(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its contrib QOperator ops in QDQ form (itself when there are none)."""
    return UnfoldQOperator()(model).model
