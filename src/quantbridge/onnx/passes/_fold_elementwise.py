"""Cases 8, 9, 12 and 14 of the fold (``__init__``): elementwise ops, concatenation, activations.

* Case 8: ``Add`` (and a two-input ``Sum``) / ``Mul`` -> ``QLinearAdd`` / ``QLinearMul``
  (com.microsoft, broadcasting);
* Case 9: ``Concat`` -> ``QLinearConcat`` (com.microsoft), or a plain ``Concat`` of the integers
  when every input already has the output's parameters (then it is exact data movement);
* Case 12: ``Sigmoid`` / ``LeakyRelu`` -> ``QLinearSigmoid`` / ``QLinearLeakyRelu``;
* Case 14: ``DQ -> Relu/Clip -> Q`` with one set of parameters -> an integer ``Clip`` to
  ``[Q(lo), Q(hi)]``. Exact: for a code ``q`` with ``s (q - z) < lo``, ``Q(lo) >= q`` (rounding
  a value above an integer never gives less), so ``max(q, Q(lo))`` is ``Q(clip(DQ(q)))``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ...numerics import quantize
from ._graph import MS_DOMAIN, GraphView, Rewrite, attribute, attributes, node
from ._match import clip_bounds, one_type, operands, q_input, q_output, type_range
from ._registry import register_fold

_QLINEAR = {
    "Add": "QLinearAdd",
    "Sum": "QLinearAdd",  # with two inputs
    "Mul": "QLinearMul",
    "Sigmoid": "QLinearSigmoid",
    "LeakyRelu": "QLinearLeakyRelu",
}


# Case 8 (Add, Mul) and Case 12 (Sigmoid, LeakyRelu)
@register_fold("Add", "Sum", "Mul", "Sigmoid", "LeakyRelu")
def fold_elementwise(g: GraphView, op: onnx.NodeProto) -> Rewrite | None:
    """Cases 8 and 12: every input from a DQ, the output into a Q (through an absorbed
    Relu/Clip)  ==>  the com.microsoft QLinear op."""
    inputs = [q_input(g, t) for t in op.input]
    out = q_output(g, op)
    if out is None or not inputs or any(i is None for i in inputs):
        return None
    if not one_type(out.params, *(i.params for i in inputs)):
        return None
    if op.op_type == "Sum" and len(inputs) != 2:
        return None
    names, inits = operands(g, *(i.params for i in inputs), out.params)
    args = [t for i, (s, z) in zip(inputs, names[:-1], strict=True) for t in (i.tensor, s, z)]
    qop = node(
        _QLINEAR[op.op_type],
        args + list(names[-1]),
        [out.tensor],
        g.fresh(op.name or _QLINEAR[op.op_type]),
        domain=MS_DOMAIN,
        **attributes(op),
    )
    return Rewrite([op, *out.nodes], [qop], inits)


# Case 9
@register_fold("Concat")
def fold_concat(g: GraphView, concat: onnx.NodeProto) -> Rewrite | None:
    """Case 9: DQ(x_i) -> Concat -> Q  ==>  QLinearConcat, or Concat of the integers."""
    inputs = [q_input(g, t) for t in concat.input]
    out = q_output(g, concat)
    if out is None or any(i is None for i in inputs):
        return None
    name = g.fresh(concat.name or "concat")
    if all(i.params.same_as(out.params) for i in inputs):
        plain = node("Concat", [i.tensor for i in inputs], [out.tensor], name, **attributes(concat))
        return Rewrite([concat, *out.nodes], [plain])
    if not one_type(out.params, *(i.params for i in inputs)):
        return None
    names, inits = operands(g, out.params, *(i.params for i in inputs))
    args = list(names[0])
    for i, (s, z) in zip(inputs, names[1:], strict=True):
        args += [i.tensor, s, z]
    qconcat = node(
        "QLinearConcat", args, [out.tensor], name, domain=MS_DOMAIN, axis=attribute(concat, "axis")
    )
    return Rewrite([concat, *out.nodes], [qconcat], inits)


# Case 14
@register_fold("Relu", "Clip")
def fold_clip(g: GraphView, act: onnx.NodeProto) -> Rewrite | None:
    """Case 14: DQ -> Relu/Clip -> Q, one set of parameters  ==>  Clip on the integers."""
    x, out = q_input(g, act.input[0]), q_output(g, act)
    bounds = clip_bounds(g, act)
    if x is None or out is None or bounds is None or not x.params.same_as(out.params):
        return None
    if g.opset < 12:  # Clip on 8-bit integers needs opset 12
        return None
    p = x.params
    qmin, qmax = type_range(p.dtype)
    dtype = helper.tensor_dtype_to_np_dtype(p.dtype)
    codes = []
    for bound, edge in zip(bounds, (qmin, qmax), strict=True):
        code = (
            edge
            if bound is None
            else quantize(np.float32(bound), p.scale_value, p.zero_point_value, qmin, qmax)
        )
        codes.append(
            g.constant(
                f"{act.output[0]}_{'lo' if not codes else 'hi'}",
                np.asarray(code, dtype).reshape(()),
            )
        )
    clip = node(
        "Clip", [x.tensor, codes[0].name, codes[1].name], [out.tensor], g.fresh(act.name or "clip")
    )
    return Rewrite([act, *out.nodes], [clip], codes)
