"""The decomposed layer norm of files exported below opset 17 (no LayerNormalization op: torch's
TorchScript exporter and many older exporters write it out), recognised as one
LayerNormalization node before lowering, so that it becomes the ``layernorm`` step
(``_normalize``):

    m = ReduceMean(X, axes=[-1]); d = Sub(X, m); v = ReduceMean(Pow(d, 2), axes=[-1])
    Div(d, Sqrt(Add(v, eps)))              (then Mul gamma, Add beta: lowered as they are)

``X`` a dequantized 8-bit tensor, both ReduceMeans over the same last axis with keepdims, the
exponent exactly 2, ``eps`` a scalar constant. A QuantizeLinear -> DequantizeLinear pair on
``v`` or on ``v + eps`` (ONNX Runtime's quantize_static writes both, 8-bit) is read through:
the ``layernorm`` step computes the variance exactly in int64, where the file rounds it to its
8-bit grid first: NOT reproduced. The file's rounding moves a row's normalized value ``n`` by up
to ``|n| s_v / (4 var)`` (``s_v`` the variance's step): under one output step on rows whose
variance is near the calibrated range (ORT's TorchScript BERT: the layer norms within 1 LSB of
ORT), several on rows of much smaller variance (measured: 5 steps at 1/100 of the largest;
``tests/integer/test_integer_decomposed_layernorm.py``). A pattern that starts like a layer norm (``Sub(X, ReduceMean(X))`` read by a Pow) and
differs anywhere else is refused naming the node and what differs.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...numerics import dequantize, quantize
from ._core import LoweringError, node_name


def _graph_maps(graph: onnx.GraphProto):
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    for o in graph.output:
        consumers.setdefault(o.name, []).append(None)
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            inits[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return producer, consumers, inits


def _attr(node: onnx.NodeProto, name: str, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _axes(node: onnx.NodeProto, inits: dict) -> list[int] | None:
    axes = _attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        axes = inits.get(node.input[1])
    return None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]


def _constant(t: str, producer: dict, inits: dict, used: list) -> np.ndarray | None:
    """A constant's value as the file computes it: a float constant, a DequantizeLinear of an
    integer one, or QuantizeLinear -> DequantizeLinear of a float one. ``used``: the nodes."""
    if t in inits:
        return np.asarray(inits[t], np.float64)
    p = producer.get(t)
    if p is None or p.op_type != "DequantizeLinear":
        return None
    scale, zero = inits.get(p.input[1]), inits.get(p.input[2]) if len(p.input) > 2 else 0
    if scale is None or zero is None:
        return None
    used.append(p)
    if p.input[0] in inits:
        return np.asarray(dequantize(inits[p.input[0]], scale, zero), np.float64)
    q = producer.get(p.input[0])
    if q is None or q.op_type != "QuantizeLinear" or q.input[0] not in inits:
        return None
    used.append(q)
    info = np.iinfo(np.asarray(zero).dtype)
    codes = quantize(inits[q.input[0]], scale, zero, int(info.min), int(info.max))
    return np.asarray(dequantize(codes, scale, zero), np.float64)


def _through_qdq(t: str, producer: dict, used: list) -> str:
    """``t``'s float source through one QuantizeLinear -> DequantizeLinear pair, else ``t``."""
    p = producer.get(t)
    if p is not None and p.op_type == "DequantizeLinear":
        q = producer.get(p.input[0])
        if q is not None and q.op_type == "QuantizeLinear":
            used += [p, q]
            return q.input[0]
    return t


def _match(div: onnx.NodeProto, producer: dict, inits: dict):
    """``(x, eps, nodes)`` of a decomposed layer norm ending at ``div``; None where ``div`` is
    not one; LoweringError where it starts as one (``Sub(X, ReduceMean(X))`` raised to a power)
    and differs elsewhere."""
    sub = producer.get(div.input[0])
    if sub is None or sub.op_type != "Sub":
        return None
    mean = producer.get(sub.input[1])
    if mean is None or mean.op_type != "ReduceMean" or mean.input[0] != sub.input[0]:
        return None
    used: list = []
    sqrt_in = _through_qdq(div.input[1], producer, used)
    sqrt = producer.get(sqrt_in)
    if sqrt is None or sqrt.op_type != "Sqrt":
        return None
    name = f"Div {node_name(div)!r}"

    def refuse(what: str):
        raise LoweringError(
            f"{name} reads what looks like a decomposed layer norm (x - mean(x)) / sqrt(var + eps) "
            f"of {sub.input[0]!r}, but {what}: only the exact pattern (both ReduceMeans over the "
            "same last axis with keepdims, Pow exponent 2, a scalar epsilon) is lowered to the "
            "layernorm step; export at opset >= 17 (one LayerNormalization op) to lower it"
        )

    add = producer.get(_through_qdq(sqrt.input[0], producer, used))
    if add is None or add.op_type != "Add":
        refuse(f"Sqrt {node_name(sqrt)!r} does not read Add(variance, eps)")
    var_t, eps = None, None
    for i in (0, 1):
        c = _constant(add.input[i], producer, inits, used)
        if c is not None:
            eps, var_t = c, add.input[1 - i]
    if eps is None or eps.size != 1 or not float(eps.reshape(-1)[0]) >= 0:
        refuse(f"Add {node_name(add)!r} does not add a scalar non-negative constant")
    var = producer.get(_through_qdq(var_t, producer, used))
    if var is None or var.op_type != "ReduceMean":
        refuse(f"Add {node_name(add)!r} does not read a ReduceMean of the squares")
    power = producer.get(var.input[0])
    if power is None or power.op_type != "Pow" or power.input[0] != sub.output[0]:
        refuse(f"ReduceMean {node_name(var)!r} does not read Pow(x - mean(x), 2)")
    exponent = _constant(power.input[1], producer, inits, used)
    if exponent is None or exponent.size != 1 or float(exponent.reshape(-1)[0]) != 2.0:
        refuse(f"Pow {node_name(power)!r} has exponent {exponent} (not the constant 2)")
    axes = [_axes(mean, inits), _axes(var, inits)]
    if axes[0] != axes[1] or axes[0] is None or len(axes[0]) != 1:
        refuse(f"the ReduceMeans reduce axes {axes[0]} and {axes[1]}")
    if any(_attr(n, "keepdims", 1) != 1 for n in (mean, var)):
        refuse("a ReduceMean drops the reduced axis (keepdims=0)")
    nodes = [mean, sub, power, var, add, sqrt, div, *used]
    return sub.input[0], float(eps.reshape(-1)[0]), axes[0][0], nodes


def fuse_decomposed_layer_norms(model: onnx.ModelProto, shapes: dict) -> onnx.ModelProto:
    """A copy of ``model`` with each decomposed layer norm (module docstring) one
    LayerNormalization (scale 1, bias 0; the Mul / Add after it stay) writing the Div's output;
    ``model`` itself when there is none. ``shapes``: the original's inferred shapes (the rank)."""
    graph = model.graph
    producer, consumers, inits = _graph_maps(graph)
    found = []
    for n in graph.node:
        if n.op_type == "Div" and len(n.input) == 2:
            m = _match(n, producer, inits)
            if m is not None:
                found.append(m)
    if not found:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    drop: set[int] = set()
    new_nodes: dict[str, onnx.NodeProto] = {}  # Div output -> its LayerNormalization
    extra = []
    for x, eps, axis, nodes in found:
        div = nodes[6]
        rank = len(shapes.get(x, ()))
        if axis != -1 and not (rank and axis % rank == rank - 1):
            raise LoweringError(f"Div {node_name(div)!r}: a decomposed layer norm over axis "
                                f"{axis} of a rank-{rank or '?'} tensor; only the last axis is "
                                "lowered")  # fmt: skip
        inner = {o for nd in nodes for o in nd.output} - {div.output[0]}
        if any(c is None or c not in nodes for t in inner for c in consumers.get(t, [])):
            continue  # an intermediate read elsewhere: leave the nodes (lowered as they are)
        dim = (shapes.get(x) or (None,))[-1]
        if dim is None:
            continue
        name = node_name(div) + "_layer_norm"
        extra += [numpy_helper.from_array(np.ones(dim, np.float32), name + "_scale"),
                  numpy_helper.from_array(np.zeros(dim, np.float32), name + "_bias")]  # fmt: skip
        new_nodes[div.output[0]] = helper.make_node(
            "LayerNormalization", [x, name + "_scale", name + "_bias"], [div.output[0]],
            name=name, axis=-1, epsilon=eps,
        )  # fmt: skip
        drop |= {id(nd) for nd in nodes}
    if not new_nodes:
        return model
    kept = []
    for n in graph.node:
        if n.output and n.output[0] in new_nodes:
            kept.append(new_nodes[n.output[0]])
        elif id(n) not in drop:
            kept.append(n)
    del out.graph.node[:]
    out.graph.node.extend(kept)
    out.graph.initializer.extend(extra)
    return out
