"""``qonnx_to_qcdq``: QONNX's ``Quant`` op (domain ``qonnx.custom_op.general``, as Brevitas's
``export_qonnx`` and FINN write it) rewritten to ``QuantizeLinear -> Clip -> DequantizeLinear``,
the form Brevitas's ``export_onnx_qcdq`` writes for the same quantizer.

``Quant(x, scale, zero_point, bit_width; signed, narrow, rounding_mode)`` computes (QONNX's
``quant`` in ``qonnx/custom_op/general/quant.py``)
``y = (clip(round(x / scale + zero_point), qmin, qmax) - zero_point) * scale`` with
``qmin = -2**(b-1) + narrow``, ``qmax = 2**(b-1) - 1`` when signed, ``[0, 2**b - 1 - narrow]``
otherwise, ``round`` half to even for ``ROUND``. With an integer zero point that is exactly
``DQ(clip(Q(x), qmin, qmax))`` on an 8-bit type (``Q`` saturates to the type, the Clip then to
``[qmin, qmax]``, the same because the type's range contains it).

A ``Quant`` of a constant wider than 8 bits (Brevitas's int32 bias) is evaluated to its float
value (exact: the codes times the scale in float64, rounded once to float32), as the QCDQ export
writes a float bias. Refused, naming the node and the fix: other rounding modes, bit widths
above 8 or not constant,
non-integer zero points, a scale varying along more than one axis, ``BipolarQuant`` / ``Trunc``
/ other QONNX ops. A model with no QONNX op is returned as it is.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._graph_index import unique_name

QONNX_DOMAINS = frozenset({"qonnx.custom_op.general", "finn.custom_op.general"})
_FIX = (
    "re-export it with brevitas.export.export_onnx_qcdq (QuantizeLinear -> Clip -> "
    "DequantizeLinear), or convert it with qonnx's QuantToQCDQ transformation"
)


def _label(n: onnx.NodeProto) -> str:
    return f"QONNX node {n.name or n.output[0]!r} (op {n.op_type})"


def _axis(node: onnx.NodeProto, scale: np.ndarray, rank: int | None) -> int | None:
    """The per-channel axis of a broadcast-shaped scale (None: per tensor)."""
    if scale.size == 1:
        return None
    varying = [i for i, d in enumerate(scale.shape) if d > 1]
    if len(varying) != 1 or rank is None:
        raise ValueError(
            f"{_label(node)}: scale of shape {list(scale.shape)} varies along more than one "
            f"axis or the input's rank is unknown; quantbridge reads per-tensor and per-channel "
            f"scales only; {_FIX}"
        )
    return rank - scale.ndim + varying[0]


def _quant_constant(x, scale, zero, bits, attrs) -> np.ndarray:
    """QONNX's formula on a constant (a 32-bit bias): its float value, exact in float64."""
    signed, narrow, n = int(attrs.get("signed", 1)), int(attrs.get("narrow", 0)), int(bits)
    lo, hi = (-(2 ** (n - 1)) + narrow, 2 ** (n - 1) - 1) if signed else (0, 2**n - 1 - narrow)
    s, z = scale.astype(np.float64), zero.astype(np.float64)
    codes = np.clip(np.round(x.astype(np.float64) / s + z), lo, hi)
    return ((codes - z) * s).astype(np.float32)


def _rewrite(node, consts, ranks, opset, fresh) -> tuple[list, list]:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    mode = attrs.get("rounding_mode", b"ROUND")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    x, s, z, b = (list(node.input) + ["", "", ""])[:4]
    scale, zero, bits = consts.get(s), consts.get(z), consts.get(b)
    if node.op_type != "Quant" or mode.upper() != "ROUND":
        what = f"rounding_mode {mode}" if node.op_type == "Quant" else "this op"
        raise ValueError(f"{_label(node)}: {what} has no ONNX QuantizeLinear form; {_FIX}")
    if x in consts and scale is not None and zero is not None and bits is not None and bits > 8:
        return [], [numpy_helper.from_array(_quant_constant(consts[x], scale, zero, bits, attrs),
                                            node.output[0])]  # fmt: skip
    if scale is None or zero is None or bits is None or bits.size != 1 or not 2 <= bits <= 8:
        raise ValueError(
            f"{_label(node)}: scale, zero point and bit width must be constants, the bit width "
            f"2..8 (got {None if bits is None else bits.ravel().tolist()}); {_FIX}"
        )
    if np.any(zero != np.round(zero)):
        raise ValueError(f"{_label(node)}: zero point {zero.ravel()[:4].tolist()} is not an integer; {_FIX}")  # fmt: skip
    axis = _axis(node, scale, ranks.get(x))
    if axis is not None and opset < 13:
        raise ValueError(f"{_label(node)}: a per-channel scale needs opset >= 13; {_FIX}")
    signed, narrow, n = int(attrs.get("signed", 1)), int(attrs.get("narrow", 0)), int(bits)
    lo, hi = (-(2 ** (n - 1)) + narrow, 2 ** (n - 1) - 1) if signed else (0, 2**n - 1 - narrow)
    dtype = np.int8 if signed else np.uint8
    flat = (lambda a: a.reshape(-1)) if axis is not None else (lambda a: a.reshape(()))
    zero = np.broadcast_to(zero, scale.shape) if zero.size == 1 and axis is not None else zero
    base = node.name or node.output[0]
    names = [fresh(f"{base}/{k}") for k in ("scale", "zero_point", "qmin", "qmax", "q", "c")]
    inits = [
        numpy_helper.from_array(flat(scale.astype(np.float32)), names[0]),
        numpy_helper.from_array(flat(zero.astype(dtype)), names[1]),
        numpy_helper.from_array(np.array(lo, dtype), names[2]),
        numpy_helper.from_array(np.array(hi, dtype), names[3]),
    ]
    ax = {} if axis is None else {"axis": axis}
    nodes = [
        helper.make_node("QuantizeLinear", [x, names[0], names[1]], [names[4]], name=f"{base}/Q", **ax),
        helper.make_node("Clip", [names[4], names[2], names[3]], [names[5]], name=f"{base}/Clip"),
        helper.make_node("DequantizeLinear", [names[5], names[0], names[1]], list(node.output),
                         name=f"{base}/DQ", **ax),
    ]  # fmt: skip
    return nodes, inits


def qonnx_to_qcdq(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every QONNX ``Quant`` as Q -> Clip -> DQ (module docstring)."""
    g = model.graph
    if not any(n.domain in QONNX_DOMAINS for n in g.node):
        return model
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    consts = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    ranks = {k: v.ndim for k, v in consts.items()}
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
        for v in [*inferred.input, *inferred.value_info, *inferred.output]:
            if v.type.tensor_type.HasField("shape"):
                ranks.setdefault(v.name, len(v.type.tensor_type.shape.dim))
    except Exception:  # unknown domains: ranks from initializers and inputs only
        pass
    used = {t for n in g.node for t in (*n.input, *n.output)} | set(consts)

    def fresh(base: str) -> str:
        return unique_name(base, used)

    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    for n in g.node:
        if n.domain not in QONNX_DOMAINS:
            out.graph.node.append(n)
            continue
        nodes, inits = _rewrite(n, consts, ranks, opset, fresh)
        out.graph.node.extend(nodes)
        out.graph.initializer.extend(inits)
    keep = [o for o in out.opset_import if o.domain not in QONNX_DOMAINS]
    del out.opset_import[:]
    out.opset_import.extend(keep)
    return out
