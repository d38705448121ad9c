"""Cases 4-7 of the fold (``__init__``): the weighted ops.

* Case 4: ``Conv`` -> ``QLinearConv`` (grouped and depthwise alike: ``group`` is copied);
* Case 5: ``Gemm`` -> ``QGemm`` (com.microsoft; ``alpha == beta == 1``, ``transA == 0``; B a
  stored weight or a per-tensor quantized activation);
* Case 6: ``MatMul`` -> ``QLinearMatMul`` (weights or two activations);
* Case 7: ``MatMul`` + ``Add(bias)`` -> ``QGemm`` (nn.Linear as exported for any input rank;
  inputs of rank > 2 are reshaped to 2-D and back, on the integers).

Weights are integer initializers behind a DequantizeLinear, per tensor or per output channel
with zero points 0. The bias becomes int32 at ``scale = input_scale * weight_scale``
(``numerics.bias_scale``): an int32 bias stored at exactly that scale is used as it is (this is
what ONNX Runtime's own QDQ fusion runs); a float bias, or an int32 bias stored at another scale,
is (re)quantized by ``numerics.quantize_bias`` (an error of at most half an accumulator step,
``input_scale * weight_scale / 2``, far below one output step). A bias that int32 cannot hold
at that scale (``numerics.fit_weight_scale_to_bias`` would raise the file's weight step) is not
folded: the op stays QDQ, where its bias is exact, rather than saturate.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from ...numerics import bias_scale, dequantize, fit_weight_scale_to_bias, quantize_bias
from ._graph import MS_DOMAIN, GraphView, QParams, Rewrite, attribute, attributes, node
from ._match import QInput, QOutput, one_type, operands, q_input, q_output, weight_for
from ._registry import register_fold


def _weight(g: GraphView, tensor: str, channel_axis: int) -> QInput | None:
    """A stored integer weight behind a DQ: per tensor, or per channel along ``channel_axis``
    with zero points 0 (what QLinearConv / QGemm / QLinearMatMul accept) or, uint8, all 128
    (``weight_for`` moves those to int8 with zero points 0 for int8 activations)."""
    w = q_input(g, tensor, per_tensor=False)
    if w is None or w.tensor not in g.constants:
        return None
    p = w.params
    if p.per_tensor:
        return w
    rank = len(g.constants[w.tensor].dims)
    symmetric_u8 = p.dtype == TensorProto.UINT8 and np.all(p.zero_point_value == 128)
    if p.axis % rank != channel_axis % rank or (
        np.any(p.zero_point_value != 0) and not symmetric_u8
    ):
        return None
    return w


def _bias(g: GraphView, tensor: str, x: QParams, w: QParams) -> tuple[str, list] | None:
    """The int32 bias tensor name at ``x.scale * w.scale`` (and new initializers), "" when there
    is no bias, None when the bias is not a constant."""
    if not tensor:
        return "", []
    target = bias_scale(x.scale_value.ravel()[0], w.scale_value.ravel())
    dq = g.produced_by(tensor, "DequantizeLinear")
    if dq is not None:
        p, stored = g.qparams(dq), g.array(dq.input[0])
        if p is None or stored is None:
            return None
        scale = p.scale_value.ravel()
        same_scale = scale.size in (1, target.size) and bool(np.all(scale == target.ravel()))
        if stored.dtype == np.int32 and same_scale and np.all(p.zero_point_value == 0):
            return (dq.input[0], []) if stored.ndim == 1 else None
        value = dequantize(stored, p.scale_value, p.zero_point_value, p.axis)
    else:
        value = g.array(tensor)
        if value is None:
            return None
    if value.ndim != 1:
        return None
    x_scale, w_scale = x.scale_value.ravel()[0], w.scale_value.ravel()
    if np.any(fit_weight_scale_to_bias(value, x_scale, w_scale) != w_scale):
        return None  # int32 would saturate at the file's weight step: the op stays QDQ
    codes = g.constant(tensor + "_int32", quantize_bias(value, x_scale, w_scale))
    return codes.name, [codes]


# Case 4
@register_fold("Conv")
def fold_conv(g: GraphView, conv: onnx.NodeProto) -> Rewrite | None:
    """Case 4: DQ(x), DQ(w) [, bias] -> Conv [-> Relu/Clip] -> Q  ==>  QLinearConv."""
    x, w, out = q_input(g, conv.input[0]), _weight(g, conv.input[1], 0), q_output(g, conv)
    if x is None or w is None or out is None or not one_type(x.params, out.params):
        return None
    bias = _bias(g, conv.input[2] if len(conv.input) > 2 else "", x.params, w.params)
    typed = weight_for(g, x.params, w)
    if bias is None or typed is None:
        return None
    w, w_inits = typed
    names, inits = operands(g, x.params, w.params, out.params)
    (xs, xz), (ws, wz), (ys, yz) = names
    inputs = [x.tensor, xs, xz, w.tensor, ws, wz, ys, yz] + ([bias[0]] if bias[0] else [])
    qconv = node(
        "QLinearConv", inputs, [out.tensor], g.fresh(conv.name or "qconv"), **attributes(conv)
    )
    return Rewrite([conv, *out.nodes], [qconv], inits + bias[1] + w_inits)


def _qgemm(g, name, a: QInput, b: QInput, bias, out: QOutput, a_tensor, out_tensor, trans_b):
    names, inits = operands(g, a.params, b.params, out.params)
    (as_, az), (bs, bz), (ys, yz) = names
    inputs = [a_tensor, as_, az, b.tensor, bs, bz, bias[0], ys, yz]
    qgemm = node(
        "QGemm",
        inputs,
        [out_tensor],
        g.fresh(name or "qgemm"),
        domain=MS_DOMAIN,
        transA=0,
        transB=trans_b,
        alpha=1.0,
    )
    return qgemm, inits + bias[1]


# Case 5
@register_fold("Gemm")
def fold_gemm(g: GraphView, gemm: onnx.NodeProto) -> Rewrite | None:
    """Case 5: DQ(a), DQ(b) [, bias] -> Gemm [-> Relu/Clip] -> Q  ==>  QGemm."""
    if attribute(gemm, "alpha", 1.0) != 1.0 or attribute(gemm, "transA", 0) != 0:
        return None
    if len(gemm.input) > 2 and gemm.input[2] and attribute(gemm, "beta", 1.0) != 1.0:
        return None
    trans_b = attribute(gemm, "transB", 0)
    a, out = q_input(g, gemm.input[0]), q_output(g, gemm)
    b = _weight(g, gemm.input[1], 0 if trans_b else 1) or q_input(g, gemm.input[1])
    if a is None or b is None or out is None or not one_type(a.params, out.params):
        return None
    bias = _bias(g, gemm.input[2] if len(gemm.input) > 2 else "", a.params, b.params)
    typed = weight_for(g, a.params, b)
    if bias is None or typed is None:
        return None
    b, b_inits = typed
    qgemm, inits = _qgemm(g, gemm.name, a, b, bias, out, a.tensor, out.tensor, trans_b)
    return Rewrite([gemm, *out.nodes], [qgemm], inits + b_inits)


# Case 6 (and Case 7 through _fold_linear)
@register_fold("MatMul")
def fold_matmul(g: GraphView, matmul: onnx.NodeProto) -> Rewrite | None:
    """Case 6: DQ(a), DQ(b) -> MatMul -> Q  ==>  QLinearMatMul; else Case 7."""
    a = q_input(g, matmul.input[0])
    if a is None:
        return None
    out = q_output(g, matmul)
    if out is None:
        return _fold_linear(g, matmul, a)
    b = q_input(g, matmul.input[1]) or _weight(g, matmul.input[1], -1)
    typed = weight_for(g, a.params, b) if b is not None else None
    if typed is None or not one_type(a.params, out.params):
        return None
    b, b_inits = typed
    names, inits = operands(g, a.params, b.params, out.params)
    (as_, az), (bs, bz), (ys, yz) = names
    inputs = [a.tensor, as_, az, b.tensor, bs, bz, ys, yz]
    qmatmul = node("QLinearMatMul", inputs, [out.tensor], g.fresh(matmul.name or "qmatmul"))
    return Rewrite([matmul, *out.nodes], [qmatmul], inits + b_inits)


# Case 7
def _fold_linear(g: GraphView, matmul: onnx.NodeProto, a: QInput) -> Rewrite | None:
    """Case 7: DQ(a), DQ(w) -> MatMul -> Add(bias) [-> Relu/Clip] -> Q  ==>  QGemm, with
    ``a`` reshaped to [-1, K] and the result back to a's leading dims (when they are static
    except the first)."""
    add = g.sole_consumer(matmul.output[0])
    b = _weight(g, matmul.input[1], 1)
    if add is None or add.op_type != "Add" or b is None or len(g.constants[b.tensor].dims) != 2:
        return None
    bias_input = add.input[1] if add.input[0] == matmul.output[0] else add.input[0]
    out = q_output(g, add)
    bias = _bias(g, bias_input, a.params, b.params) if out is not None else None
    if bias is None or not bias[0] or not one_type(a.params, out.params):
        return None
    n_out = g.constants[b.tensor].dims[1]
    typed = weight_for(g, a.params, b)
    if typed is None:
        return None
    b, b_inits = typed
    shape = g.shapes.get(matmul.input[0])
    if shape is None or len(shape) < 2 or any(d is None for d in shape[1:]):
        return None
    name = matmul.name or "qgemm"
    if len(shape) == 2:
        qgemm, inits = _qgemm(g, name, a, b, bias, out, a.tensor, out.tensor, 0)
        return Rewrite([matmul, add, *out.nodes], [qgemm], inits + b_inits)
    to_2d = g.constant(name + "_2d", np.array([-1, shape[-1]], np.int64))
    back = g.constant(name + "_nd", np.array([-1, *shape[1:-1], n_out], np.int64))
    flat, result = g.fresh(a.tensor + "_2d"), g.fresh(out.tensor + "_2d")
    reshape_in = node("Reshape", [a.tensor, to_2d.name], [flat], g.fresh(name + "_reshape"))
    qgemm, inits = _qgemm(g, name, a, b, bias, out, flat, result, 0)
    reshape_out = node("Reshape", [result, back.name], [out.tensor], g.fresh(name + "_reshape"))
    return Rewrite(
        [matmul, add, *out.nodes], [reshape_in, qgemm, reshape_out], inits + [to_2d, back] + b_inits
    )
