"""The slope bound of an elementwise float chain between two quantized tensors (``compare``'s
credit for an error carried through a GELU, a SiLU, an Exp ...).

A site ``s`` whose ``QuantizeLinear`` reads ``f(u)``, ``u`` one quantized site read through its
``DequantizeLinear`` and ``f`` a chain of elementwise ops with scalar constants (the exporter's
decomposed GELU ``x * 0.5 * (1 + erf(x / sqrt 2))``, ``x * sigmoid(x)``, ``HardSwish``, ``Exp``
...), possibly with element-selecting ops (``Transpose``, ``Reshape``, ``Slice`` ...) in between
and ``Where`` of conditions computed from ``u`` (the exporter's ``Where(IsNaN(p), 0, p)`` after
a Softmax: slope 1),
can differ between two engines by at most ``L * e``, ``e`` the largest difference of ``u`` and
``L`` the largest slope of ``f`` between two neighbouring codes of ``u``:
``L = max_k |f(x_{k+1}) - f(x_k)| / step``, ``x_k = (k - zero_point) * step`` over every code of
``u``. Both engines read ``u`` as codes on that grid, and a difference of ``j`` codes is a sum of
``j`` neighbouring steps, so ``L`` bounds every pair of codes: it is the exact bound for the
values ``u`` can take, whatever the op, including value-dependent slopes (``Exp`` on ``u``'s
range) and jumps. ``f`` is evaluated with ONNX's reference evaluator (float32, like the
engines). Element-selecting ops commute with an elementwise ``f`` whose constants are scalars:
they are evaluated as ``Identity``. For reference, the slopes over the whole real line:
ReLU, Clip, Tanh 1; LeakyRelu max(1, |alpha|); Sigmoid 1/4; HardSigmoid alpha (torch: 1/6);
GELU ``max d/dx x Phi(x) = Phi(sqrt 2) + sqrt 2 phi(sqrt 2) = 1.1289``; SiLU ``1.0998`` (at
x = 2.3994); HardSwish ``3/2`` (at x = 3); Softplus 1; Erf ``2 / sqrt pi``
(``tests/debug/test_compare_gain.py`` checks them).

Weighted ops of one site by constant weights are linear: the difference of their outputs is the
op applied to the difference of their inputs, exactly, ``x_b @ W - x_a @ W = dx @ W`` and
``conv(x_b, W) - conv(x_a, W) = conv(dx, W)`` with ``dx = x_b - x_a`` signed, element by element
(``linear_weight``, ``conv_weight``, ``conv_bound``: Conv, ConvTranspose, depthwise, with the same
strides, pads, dilations and groups). A bias is a constant (no error), and a Relu or Clip after
the op cannot grow a difference (1-Lipschitz): ``|y_b - y_a| <= |conv(dx, W)|`` element by
element, in real arithmetic, for any two inputs. Each engine then rounds its own ``y`` to the
output grid (at most half a step each, + float32 accumulation noise): ``classify``'s one step.
The earlier bound ``conv(|dx|, |W|)`` (every product's difference with the same sign, over the
whole window, compared at its largest element with the tensor's largest difference) is also
true but on PP-OCRv4 det up to ~4x the actual difference (docs/debugging.md): real differences
cancel in the sum, and ``|conv(dx, W)|`` keeps that cancellation. A float graph output of such
an op in float (a float head), then possibly a Sigmoid (slope <= 1/4) or Tanh (<= 1), gets
``L |conv(dx, W)|`` (``weighted_output``).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

# ops that move or select elements of their first input (they commute with an elementwise f)
SELECTING_OPS = frozenset(
    {"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Gather", "Identity",
     "DepthToSpace", "SpaceToDepth", "Tile", "Expand", "GatherElements", "GatherND"}
)  # fmt: skip
# elementwise float ops (all inputs broadcast together, output element i from inputs' element i)
ELEMENTWISE_OPS = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Neg", "Abs", "Sqrt", "Reciprocal", "Exp",
     "Log", "Erf", "Tanh", "Sigmoid", "HardSigmoid", "HardSwish", "Relu", "LeakyRelu", "Clip",
     "Elu", "Selu", "Celu", "Gelu", "Mish", "Softplus", "Softsign", "Sin", "Cos", "PRelu",
     # selection: Where(cond(u), c, f(u)) picks, element by element, a branch computed from u
     # (the exporter's Where(IsNaN(p), 0, p) after a Softmax; Where(u > t, u, c)); the
     # condition is a function of u too, so the table over u's codes holds the jumps
     "Where", "IsNaN", "IsInf", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual",
     "Not", "And", "Or", "Xor"}
)  # fmt: skip
_LIMIT = 64  # nodes in one chain; a longer one gets no credit
_MAX_CODES = 1 << 16


def elementwise_gain(
    node: onnx.NodeProto, sites: dict, producer: dict, consts: dict, opset: int
) -> dict:
    """For a QuantizeLinear ``node`` reading ``f(u)`` as above: ``{"inputs": (u,), "gain": L}``;
    else ``{}``. ``sites``: name -> Site (``u`` needs a scalar step), ``producer``: tensor ->
    node, ``consts``: constant tensors."""
    if node.op_type != "QuantizeLinear":
        return {}
    found = _chain(node.input[0], sites, producer, consts)
    if found is None:
        return {}
    chain, leaf, used_consts, u = found
    site = sites[u]
    values = _values(chain, leaf, used_consts, node.input[0], site, opset)
    if values is None:
        return {}
    return {"inputs": (u,), "gain": float(np.abs(np.diff(values)).max() / site.scale)}


def _chain(start: str, sites: dict, producer: dict, consts: dict):
    """``(chain, leaf, constants, u)`` of an elementwise chain computing ``start`` from one site
    ``u`` (module docstring); None for anything else (a plain DequantizeLinear of a site too)."""
    chain: list[onnx.NodeProto] = []
    leaf: set[str] = set()  # DequantizeLinear outputs of the one input site
    used_consts: dict[str, np.ndarray] = {}
    source: set[str] = set()
    todo, seen = [start], set()
    while todo:
        t = todo.pop()
        if not t or t in seen:
            continue
        seen.add(t)
        if t in consts:
            if np.asarray(consts[t]).size != 1:
                return None  # a per-channel constant: f differs along an axis
            used_consts[t] = np.asarray(consts[t])
            continue
        p = producer.get(t)
        if p is None:
            return None  # a graph input other than a site
        if p.op_type == "DequantizeLinear" and p.input[0] in sites:
            leaf.add(t)
            source.add(p.input[0])
            continue
        if p.op_type in SELECTING_OPS:
            todo.append(p.input[0])
        elif p.op_type in ELEMENTWISE_OPS:
            todo.extend(p.input)
        else:
            return None
        chain.append(p)
        if len(chain) > _LIMIT or len(source) > 1:
            return None
    if len(source) != 1 or all(n.op_type in SELECTING_OPS for n in chain):
        return None
    (u,) = source
    site = sites[u]
    if site.scale is None or not site.scale > 0:
        return None
    return chain, leaf, used_consts, u


def two_site_chain(
    node: onnx.NodeProto, sites: dict, producer: dict, consts: dict, opset: int
) -> dict:
    """For a QuantizeLinear ``node`` reading ``g(u) * h(v)``, ``g(u) + h(v)`` or ``g(u) - h(v)``,
    ``u`` and ``v`` two sites and ``g``, ``h`` elementwise chains of one site each (or the site
    itself; ``x * sigmoid(y)``, a gate): ``{"factors": (u, v), "chains": (G, H), "combine":
    op}``, ``G`` = ``(values of g over u's codes, or None for g = identity; g's slope bound)``.
    ``compare._carried`` bounds ``|dg| <= L_g |du|`` element by element and combines as for a
    product (``|dg| |h| + |g| |dh| + |dg| |dh|``) or a sum (``|dg| + |dh|``), with ``g``, ``h``
    the reference's values (read from the table at its codes). ``{}`` where the two operands
    are plain sites (``product``) or one site (``elementwise_gain``)."""
    p = producer.get(node.input[0]) if node.op_type == "QuantizeLinear" else None
    if p is None or p.op_type not in ("Mul", "Add", "Sub") or len(p.input) != 2:
        return {}
    sides = []
    for t in p.input:
        q = producer.get(t)
        if q is not None and q.op_type == "DequantizeLinear" and q.input[0] in sites:
            site = sites[q.input[0]]
            if site.scale is None or not site.scale > 0:
                return {}
            sides.append((q.input[0], None, 1.0, site))
            continue
        found = _chain(t, sites, producer, consts)
        if found is None:
            return {}
        chain, leaf, used, u = found
        values = _values(chain, leaf, used, t, sites[u], opset)
        if values is None:
            return {}
        sides.append((u, values, float(np.abs(np.diff(values)).max() / sites[u].scale), sites[u]))
    (u, g, _, _), (v, h, _, _) = sides
    if u == v or (g is None and h is None):
        return {}
    chains = tuple((table, slope, _grid(site)) for _, table, slope, site in sides)
    return {"factors": (u, v), "chains": chains, "combine": p.op_type}


def _grid(site) -> tuple[float, int, int]:
    """(step, zero point, lowest code) of ``site``'s codes."""
    info = np.iinfo(helper.tensor_dtype_to_np_dtype(site.elem_type))
    return float(site.scale), int(site.zero_point), int(info.min)


def chain_values(values: np.ndarray, table: np.ndarray | None, grid: tuple) -> np.ndarray:
    """``g`` at the dequantized ``values`` of a site on ``grid`` (``_grid``): ``table`` (``g``
    over every code, from the lowest) read at their codes; ``values`` for ``g`` = identity."""
    if table is None:
        return np.asarray(values, np.float64)
    step, zero, lowest = grid
    codes = np.rint(np.asarray(values, np.float64) / step) + zero
    index = np.clip(codes - lowest, 0, table.size - 1).astype(np.int64)
    return table[index]


def _codes(site) -> np.ndarray:
    """Every value ``site`` can take: its codes, dequantized (float32, like the engines)."""
    info = np.iinfo(helper.tensor_dtype_to_np_dtype(site.elem_type))
    if info.max - info.min + 1 > _MAX_CODES:
        return np.zeros(0, np.float32)
    k = np.arange(info.min, info.max + 1, dtype=np.float64)
    return ((k - site.zero_point) * site.scale).astype(np.float32)


def _values(chain, leaf, used_consts, out, site, opset) -> np.ndarray | None:
    """``f`` over every code of ``site`` (float64 of the float32 evaluation); None where ``f``
    is not finite there or the chain does not evaluate."""
    from onnx.reference import ReferenceEvaluator

    x = _codes(site)
    if x.size < 2:
        return None
    nodes = []
    for n in reversed(chain):  # the walk went outputs -> inputs
        ins = ["x" if i in leaf else i for i in n.input]
        if n.op_type in SELECTING_OPS:
            nodes.append(helper.make_node("Identity", ins[:1], list(n.output[:1])))
        else:
            nodes.append(helper.make_node(n.op_type, ins, list(n.output), domain=n.domain))
            nodes[-1].attribute.extend(n.attribute)
    inits = [numpy_helper.from_array(v.reshape(()), k) for k, v in used_consts.items()]
    graph = helper.make_graph(
        nodes, "f", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None])],
        [helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        (y,) = ReferenceEvaluator(model).run(None, {"x": x})
    except Exception:  # noqa: BLE001  (an op the evaluator lacks: no credit, as before)
        return None
    y = np.asarray(y, np.float64).reshape(-1)
    if y.shape != x.shape or not np.all(np.isfinite(y)):
        return None
    return y


def linear_weight(node: onnx.NodeProto, producer: dict, operand) -> dict:
    """For a QuantizeLinear ``node`` reading ``x @ W`` (+ a constant bias): a MatMul of one site
    ``x`` by a constant ``W`` (a DequantizeLinear of integer weights, possibly transposed, as the
    exporter writes a Linear), or a Gemm: ``{"factors": (x,), "weight": W}`` (signed, alpha
    folded in); else ``{}``. The error it carries is ``|dx @ W|`` element by element
    (``compare._carried``): exact for the input's own differences, so a 1-step difference on a
    few inputs is credited only as far as the weights they meet carry it. ``operand(t)``: a site's name, a constant's
    value, or None (``_match._operand``)."""
    if node.op_type != "QuantizeLinear":
        return {}
    return _linear_of(node.input[0], producer, operand)


def _linear_of(tensor: str, producer: dict, operand) -> dict:
    """``linear_weight`` for the float tensor ``tensor``."""
    p = producer.get(tensor)
    if p is not None and p.op_type == "Add" and len(p.input) == 2:  # the bias: no error
        kinds = [operand(t) for t in p.input]
        const = [i for i, k in enumerate(kinds) if isinstance(k, np.ndarray)]
        p = producer.get(p.input[1 - const[0]]) if len(const) == 1 else None
    if p is None or p.op_type not in ("MatMul", "Gemm") or len(p.input) < 2:
        return {}
    attrs = {a.name: helper.get_attribute_value(a) for a in p.attribute}
    if attrs.get("transA", 0):
        return {}
    x, w = operand(p.input[0]), _constant(p.input[1], producer, operand)
    if not isinstance(x, str) or w is None or w.ndim != 2:
        return {}
    if attrs.get("transB", 0):
        w = w.T
    return {"factors": (x,), "weight": w.astype(np.float64) * float(attrs.get("alpha", 1.0))}


def _constant(t: str, producer: dict, operand) -> np.ndarray | None:
    """``t``'s constant value, through Transposes (a Linear's weight as the exporter writes it)."""
    value = operand(t)
    if isinstance(value, np.ndarray):
        return value
    p = producer.get(t)
    if p is None or p.op_type != "Transpose":
        return None
    inner = _constant(p.input[0], producer, operand)
    if inner is None:
        return None
    perm = next((list(a.ints) for a in p.attribute if a.name == "perm"), None)
    return np.transpose(inner, perm)


# elementwise ops that move no two values further apart (1-Lipschitz): read through after a
# conv or a product (ReXNet's x * sigmoid(s) -> ReLU6, timm's SE gate)
_LIPSCHITZ_1 = frozenset({"Relu", "Clip"})


def below_lipschitz_1(t: str, producer: dict, operand) -> onnx.NodeProto | None:
    """The producer of ``t`` under any Relu / Clip with constant bounds (neither can grow a
    difference between two engines' values, so an error bound of their input holds for ``t``);
    None where a Clip bound is computed at run time. ``operand`` as ``linear_weight``."""
    p = producer.get(t)
    while p is not None and p.op_type in _LIPSCHITZ_1:
        if any(not isinstance(operand(b), np.ndarray) for b in p.input[1:] if b):
            return None  # a Clip bound computed at run time
        p = producer.get(p.input[0])
    return p


def product(node: onnx.NodeProto, producer: dict, operand) -> dict:
    """For a QuantizeLinear of a Mul or MatMul of two sites: ``factors`` (their names; ``matmul``
    for a MatMul); of a Mul or Div of
    one site by a constant: ``gain`` (the largest |factor|, 1 / the smallest |divisor|). The
    error a product can carry is bounded by its factors' errors (``compare._carried``), where no
    other op than a Relu or Clip (1-Lipschitz) stands between them and the QuantizeLinear.
    ``operand`` as ``linear_weight``."""
    if node.op_type != "QuantizeLinear":
        return {}
    return product_at(node.input[0], producer, operand)


def product_at(tensor: str, producer: dict, operand) -> dict:
    """``product`` for the float tensor ``tensor`` (a QuantizeLinear's input, or a float graph
    output: timm's distilled ViT's ``(head(x) + head_dist(x_dist)) / 2``, the sum a site)."""
    p = below_lipschitz_1(tensor, producer, operand)
    if p is None or p.op_type not in ("Mul", "Div", "MatMul") or len(p.input) != 2:
        return {}
    kinds = [operand(t) for t in p.input]
    named = [k for k in kinds if isinstance(k, str)]
    if p.op_type == "MatMul":  # attention's Q K^T, P V: the same bound, summed over k
        return {"factors": tuple(named), "matmul": True} if len(named) == 2 else {}
    if p.op_type == "Mul" and len(named) == 2:
        return {"factors": tuple(named)}
    const = [k for k in kinds if isinstance(k, np.ndarray) and k.size]
    if len(named) != 1 or len(const) != 1 or (p.op_type == "Div" and kinds[1] is not const[0]):
        return {}
    c = np.abs(const[0].astype(np.float64))
    if p.op_type == "Mul":
        return {"gain": float(c.max())}
    return {"gain": float(1.0 / c.min())} if c.min() > 0 else {}


_CONV_OPS = {"Conv": "conv", "ConvTranspose": "conv_transpose"}  # torch.nn.functional's, + "Nd"


def conv_weight(node: onnx.NodeProto, producer: dict, operand) -> dict:
    """For a QuantizeLinear ``node`` reading ``conv(x, W)`` (+ a constant bias, the Conv's own or
    an Add; then possibly a Relu / Clip): a Conv or ConvTranspose of one site ``x`` by constant
    weights ``W``: ``{"factors": (x,), "weight": W (signed), "conv": attributes}``; else ``{}``.
    ``conv_bound`` computes ``conv(dx, W)``, the bound is its magnitude. ``operand`` as
    ``linear_weight``."""
    if node.op_type != "QuantizeLinear":
        return {}
    return _conv_of(node.input[0], producer, operand)


# the slope bound of a final activation over the whole real line (module docstring)
_OUTPUT_SLOPES = {"Sigmoid": 0.25, "Tanh": 1.0}


def weighted_output(tensor: str, producer: dict, operand) -> dict:
    """``conv_weight`` / ``linear_weight`` for a float graph output ``tensor``: a weighted op of
    one site in float (a float head, PP-OCRv4 det's final ConvTranspose), possibly then a Sigmoid
    or Tanh: ``|f(y_b) - f(y_a)| <= L |y_b - y_a|`` element by element with ``L`` its slope
    bound, so ``weight`` is ``L W`` (``|conv(dx, L W)| = L |conv(dx, W)|``)."""
    p = producer.get(tensor)
    slope = 1.0
    if p is not None and p.op_type in _OUTPUT_SLOPES:
        slope, tensor = _OUTPUT_SLOPES[p.op_type], p.input[0]
    try:
        found = _conv_of(tensor, producer, operand) or _linear_of(tensor, producer, operand)
    except ValueError:  # a weight ``operand`` cannot read (group-wise blocks): no credit
        return {}
    if found:
        found["weight"] = found["weight"] * slope
    return found


def _conv_of(tensor: str, producer: dict, operand) -> dict:
    """``conv_weight`` for the float tensor ``tensor``."""
    p = below_lipschitz_1(tensor, producer, operand)
    if p is not None and p.op_type == "Add" and len(p.input) == 2:  # the bias: no error
        kinds = [operand(t) for t in p.input]
        const = [i for i, k in enumerate(kinds) if isinstance(k, np.ndarray)]
        p = producer.get(p.input[1 - const[0]]) if len(const) == 1 else None
    if p is None or p.op_type not in _CONV_OPS or len(p.input) < 2:
        return {}
    x, w = operand(p.input[0]), operand(p.input[1])
    bias = operand(p.input[2]) if len(p.input) > 2 and p.input[2] else np.zeros(0)
    if not isinstance(x, str) or not isinstance(w, np.ndarray) or not isinstance(bias, np.ndarray):
        return {}
    attrs = {a.name: helper.get_attribute_value(a) for a in p.attribute}
    auto_pad = attrs.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    nd = w.ndim - 2
    if nd not in (1, 2, 3) or "output_shape" in attrs:
        return {}
    if p.op_type == "ConvTranspose" and auto_pad not in ("NOTSET", "VALID"):
        return {}
    conv = {
        "op": p.op_type,
        "strides": list(attrs.get("strides", [1] * nd)),
        "dilations": list(attrs.get("dilations", [1] * nd)),
        "pads": [0] * (2 * nd) if auto_pad == "VALID" else list(attrs.get("pads", [0] * 2 * nd)),
        "auto_pad": auto_pad,
        "group": int(attrs.get("group", 1)),
        "output_padding": list(attrs.get("output_padding", [0] * nd)),
    }
    return {"factors": (x,), "weight": w.astype(np.float64), "conv": conv}


def conv_bound(dx: np.ndarray, weight: np.ndarray, conv: dict) -> np.ndarray:
    """``conv(dx, W)`` (float64, signed: the exact difference a conv of two inputs ``dx`` apart
    makes) with ``conv``'s attributes (``conv_weight``); ValueError or RuntimeError where the
    shapes do not fit (the caller gives no credit)."""
    import torch
    from torch.nn import functional as F

    nd = weight.ndim - 2
    x = torch.from_numpy(np.ascontiguousarray(dx, dtype=np.float64))
    if x.ndim != nd + 2:
        raise ValueError(f"input rank {x.ndim}, weight rank {weight.ndim}")
    w = torch.from_numpy(weight)
    strides, dilations, pads = conv["strides"], conv["dilations"], list(conv["pads"])
    fn = getattr(F, f"{_CONV_OPS[conv['op']]}{nd}d")
    with torch.no_grad():
        if conv["op"] == "ConvTranspose":
            y = fn(x, w, stride=strides, output_padding=conv["output_padding"],
                   groups=conv["group"], dilation=dilations)  # fmt: skip
            for d in range(nd):  # ONNX pads crop the full output, begin and end
                size = y.shape[2 + d] - pads[d] - pads[d + nd]
                y = y.narrow(2 + d, pads[d], size)
            return y.numpy()
        if conv["auto_pad"].startswith("SAME"):
            for d in range(nd):
                size, k = x.shape[2 + d], weight.shape[2 + d]
                out = math.ceil(size / strides[d])
                total = max(0, (out - 1) * strides[d] + (k - 1) * dilations[d] + 1 - size)
                small, large = total // 2, total - total // 2
                lower = conv["auto_pad"] == "SAME_LOWER"
                pads[d], pads[d + nd] = (large, small) if lower else (small, large)
        flat: list[int] = []
        for d in reversed(range(nd)):  # F.pad: the last dimension first
            flat += [pads[d], pads[d + nd]]
        x = F.pad(x, flat)
        return fn(x, w, stride=strides, dilation=dilations, groups=conv["group"]).numpy()
