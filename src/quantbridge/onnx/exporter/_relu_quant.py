"""Non-negative tensors on a symmetric int8 grid: stored as uint8 with zero point 0, and the ReLU
(or Clip) before them moved into the integer clamp, in the form ONNX Runtime fuses.

ONNX Runtime drops a Relu in front of a QuantizeLinear only when the QuantizeLinear's zero point is
the integer type's qmin (ReluQuantFusion): then ``clip(., qmin, qmax)`` *is* the ReLU. With a
symmetric int8 grid (zero point 0: the ``int8_symmetric`` and ``pow2`` presets) the Relu stays and
the Conv/Gemm in front of it runs in float; on x86, ONNX Runtime does not fuse int8 (signed)
activations into its integer kernels at all (DigitsCNN: 3 Conv + 1 Gemm of 5 in float, INT8 4.5x
slower than float; ``bench/forms_study/FINDINGS.md``).

The rewrite is exact. For a per-tensor int8 grid with scale ``s`` and zero point 0, ``rne`` the
round-half-to-even of QuantizeLinear (monotonic, ``rne(0) = 0``):

* ``Relu -> Q``: ``clip(rne(max(x, 0) / s), -128, 127) == clip(rne(x / s), 0, 127)``;
  ``Clip(a, b) -> Q``: ``clip(rne(clip(x, a, b) / s), ...) == clip(rne(x / s), rne(a / s), rne(b / s))``
  (``a / s`` divided in float32, as the QuantizeLinear divides ``x``). The Relu/Clip goes, the
  integer clamp does it;
* a non-negative tensor (the output of a Relu, a Sigmoid, ..., or of a max pool, reshape, add, ...
  of non-negative tensors; ``optables.NONNEGATIVE_*``) has int8 codes ``0..127``, which are the
  same numbers in uint8.

So ``[Relu ->] Q(s, 0:int8) [-> Clip(lo, hi)] -> DQ(s, 0:int8)`` becomes
``Q(s, 0:uint8) -> Clip(max(lo, 0), min(hi, 127)) -> DQ(s, 0:uint8)``: same scale, same codes,
same dequantized values. The zero point is now the type's qmin, so ONNX Runtime fuses producers
and consumers into its uint8 x int8 kernels (QLinearConv, QGemm, QLinearAdd, uint8 MaxPool); the
uint8 Clip keeps the int8 grid's top code (127), so a value above ``127 s`` saturates as before.

Measured (ORT 1.32, AVX2, ``tests/onnx/test_relu_quant.py`` and ``quantbridge demo``): DigitsCNN
int8_symmetric goes from 2 of 5 Conv/Gemm in integer kernels to 5 of 5, ResNet-18-style from 9 of
21 to 21 of 21. Keeping int8 storage with an int8 ``Clip(0, 127)`` instead of the Relu is exact
too, but ONNX Runtime then fuses none of the convolutions (int8 activations on x86).

A QuantizeLinear is rewritten only when its parameters are constant and per tensor and every
reader of its output is a DequantizeLinear (through at most one integer Clip). A Relu/Clip is
removed only when every reader of its output is a rewritten QuantizeLinear.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...optables import (
    NONNEGATIVE_ALL_INPUTS_OPS,
    NONNEGATIVE_OUTPUT_OPS,
    NONNEGATIVE_PRESERVING_OPS,
)
from .._graph_index import unique_name

_RANGE = {TensorProto.INT8: (-128, 127), TensorProto.UINT8: (0, 255)}
_NP = {TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8}


class _Graph:
    """Producers, consumers and constant values of one graph."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.consts = {i.name: i for i in graph.initializer}
        for n in graph.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                self.consts[n.output[0]] = n.attribute[0].t
        self.producer = {t: n for n in graph.node for t in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in graph.node:
            for t in n.input:
                self.consumers.setdefault(t, []).append(n)
        self.outputs = {o.name for o in graph.output}
        self.names = {t for n in graph.node for t in [*n.output, n.name]} | set(self.consts)

    def value(self, name: str) -> np.ndarray | None:
        tensor = self.consts.get(name)
        return None if tensor is None else numpy_helper.to_array(tensor)

    def fresh(self, base: str) -> str:
        return unique_name(base, self.names)

    def const(self, base: str, value: int, dtype: int) -> str:
        name = self.fresh(base)
        self.graph.initializer.append(
            numpy_helper.from_array(np.array(value, dtype=_NP[dtype]), name)
        )
        return name


def _clip_bounds(g: _Graph, clip: onnx.NodeProto) -> tuple[int, int] | None:
    bounds = [g.value(clip.input[i]) if len(clip.input) > i and clip.input[i] else None
              for i in (1, 2)]  # fmt: skip
    if any(b is None or b.size != 1 for b in bounds):
        return None
    return int(bounds[0].ravel()[0]), int(bounds[1].ravel()[0])


def _pad_constant_nonnegative(g: _Graph, pad: onnx.NodeProto) -> bool:
    """A Pad that writes no negative value: a copying mode, or a constant >= 0 (default 0).
    Without it a ReLU -> ZeroPad2d -> Conv kept int8 after the pad and uint8 before it, so
    ``_pad_codes`` (equal parameters on both sides) did not apply: a float Pad in ONNX Runtime."""
    mode = next((a.s for a in pad.attribute if a.name == "mode"), b"constant")
    if mode != b"constant" or len(pad.input) < 3 or not pad.input[2]:
        return True
    value = g.value(pad.input[2])
    return value is not None and bool(np.all(value >= 0))


def _nonnegative(g: _Graph, name: str, seen: dict[str, bool]) -> bool:
    """``name`` is >= 0 for every input of the model (sign analysis over the graph)."""
    if name in seen:
        return seen[name]
    seen[name] = False  # a cycle (none in a valid graph) proves nothing
    node, value = g.producer.get(name), g.value(name)
    if value is not None:
        result = bool(np.all(value >= 0))
    elif node is None:
        result = False
    elif node.op_type in NONNEGATIVE_OUTPUT_OPS:
        result = True
    elif node.op_type == "DequantizeLinear":
        result = _dequantizes_nonnegative(g, node, seen)
    elif node.op_type == "Clip":
        lo = g.value(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        result = (lo is not None and bool(np.all(lo >= 0))) or _nonnegative(g, node.input[0], seen)
    elif node.op_type == "Pad":
        result = _pad_constant_nonnegative(g, node) and _nonnegative(g, node.input[0], seen)
    elif node.op_type in NONNEGATIVE_ALL_INPUTS_OPS:
        result = all(_nonnegative(g, t, seen) for t in node.input if t)
    elif node.op_type in NONNEGATIVE_PRESERVING_OPS:
        result = _nonnegative(g, node.input[0], seen)
    else:
        result = False
    seen[name] = result
    return result


def _dequantizes_nonnegative(g: _Graph, dq: onnx.NodeProto, seen: dict[str, bool]) -> bool:
    """``s (q - z) >= 0``: every code ``q`` is at least the (per-tensor) zero point ``z``."""
    if len(dq.input) < 3 or not dq.input[2]:
        return True  # zero point 0 of uint8
    zp = g.value(dq.input[2])
    if zp is None or zp.size != 1:
        return False
    return _codes_at_least(g, dq.input[0], int(zp.ravel()[0]), seen)


def _codes_at_least(g: _Graph, name: str, zero_point: int, seen: dict[str, bool]) -> bool:
    """Every integer in ``name`` is >= ``zero_point``."""
    codes, node = g.value(name), g.producer.get(name)
    if codes is not None:
        return bool(np.all(codes.astype(np.int64) >= zero_point))
    if node is None:
        return False
    if node.op_type == "Clip":
        bounds = _clip_bounds(g, node)
        return (bounds is not None and bounds[0] >= zero_point) or _codes_at_least(
            g, node.input[0], zero_point, seen
        )
    if node.op_type == "QuantizeLinear" and len(node.input) > 2 and node.input[2]:
        zp = g.value(node.input[2])
        dtype = g.consts[node.input[2]].data_type if node.input[2] in g.consts else None
        if zp is None or zp.size != 1:
            return False
        if _RANGE.get(dtype, (None,))[0] is not None and _RANGE[dtype][0] >= zero_point:
            return True
        return int(zp.ravel()[0]) >= zero_point and _nonnegative(g, node.input[0], seen)
    return False


def _tail(g: _Graph, q: onnx.NodeProto):
    """``(clip or None, [DequantizeLinear readers])`` of a QuantizeLinear's output, or None when
    anything else reads it (then its storage type cannot change)."""
    users = g.consumers.get(q.output[0], [])
    if q.output[0] in g.outputs or not users:
        return None
    clip = None
    if len(users) == 1 and users[0].op_type == "Clip":
        clip = users[0]
        if _clip_bounds(g, clip) is None or clip.output[0] in g.outputs:
            return None
        users = g.consumers.get(clip.output[0], [])
    last = (clip or q).output[0]
    if not users or any(u.op_type != "DequantizeLinear" or u.input[0] != last for u in users):
        return None
    return clip, users


def _symmetric_int8(g: _Graph, q: onnx.NodeProto) -> bool:
    """A per-tensor int8 QuantizeLinear with constant scale and zero point 0."""
    if len(q.input) < 3 or not q.input[2] or q.input[2] not in g.consts:
        return False
    zp, scale = g.value(q.input[2]), g.value(q.input[1])
    return (
        g.consts[q.input[2]].data_type == TensorProto.INT8
        and scale is not None
        and scale.size == 1
        and zp.size == 1
        and int(zp.ravel()[0]) == 0
    )


def _clamp_codes(g: _Graph, node: onnx.NodeProto | None, scale: float) -> tuple[int, int] | None:
    """The int8 code range that a Relu or constant-bound Clip in front of ``Q(scale, 0)`` keeps
    (module docstring), or None when ``node`` is neither."""
    if node is None:
        return None
    if node.op_type == "Relu":
        return 0, 127
    if node.op_type != "Clip":
        return None
    lo, hi = -128, 127
    for i, pick in ((1, max), (2, min)):
        if len(node.input) <= i or not node.input[i]:
            continue
        bound = g.value(node.input[i])
        if bound is None or bound.size != 1:
            return None
        code = np.rint(np.float32(bound.ravel()[0]) / np.float32(scale))
        bound_code = int(np.clip(code, -128, 127))
        lo, hi = (pick(lo, bound_code), hi) if i == 1 else (lo, pick(hi, bound_code))
    return lo, hi


def _rewrite(g: _Graph, q: onnx.NodeProto, clamp: tuple[int, int]) -> None:
    """``q`` stores uint8 codes with zero point 0, clamped to ``clamp`` (within 0..127)."""
    clip, dequantizes = _tail(g, q)
    lo, hi = _clip_bounds(g, clip) if clip is not None else (-128, 127)
    lo, hi, dtype = max(lo, clamp[0], 0), min(hi, clamp[1], 127), TensorProto.UINT8
    zp_name = g.const(f"{q.input[2]}.uint8", 0, dtype)
    for node in [q, *dequantizes]:
        node.input[2] = zp_name
    lo_name = g.const(f"{q.output[0]}.lo", lo, dtype)
    hi_name = g.const(f"{q.output[0]}.hi", min(max(hi, lo), 127), dtype)
    if clip is None:
        clipped = g.fresh(f"{q.output[0]}.clip")
        for node in dequantizes:
            node.input[0] = clipped
        new = helper.make_node("Clip", [q.output[0], lo_name, hi_name], [clipped],
                               name=g.fresh(f"{q.name or q.output[0]}/clip"))  # fmt: skip
        g.graph.node.insert(list(g.graph.node).index(q) + 1, new)
    else:
        clip.input[1], clip.input[2] = lo_name, hi_name


def relu_into_quantize(model: onnx.ModelProto) -> tuple[int, int]:
    """Rewrite ``model`` in place (module docstring); returns (QuantizeLinear nodes now uint8,
    Relu/Clip nodes removed)."""
    g, seen = _Graph(model.graph), {}
    plan = []  # decided on the unchanged graph, then applied
    for q in model.graph.node:
        if q.op_type != "QuantizeLinear" or not _symmetric_int8(g, q) or _tail(g, q) is None:
            continue
        source = g.producer.get(q.input[0])
        clamp = _clamp_codes(g, source, float(g.value(q.input[1]).ravel()[0]))
        if clamp is not None and clamp[0] >= 0:  # Clip(-1, 1) keeps negative codes: not uint8
            plan.append((q, source, clamp))
        elif _nonnegative(g, q.input[0], seen):
            plan.append((q, None, (0, 127)))
    folded: dict[str, onnx.NodeProto] = {}
    for q, source, clamp in plan:
        _rewrite(g, q, clamp)
        if source is not None:
            q.input[0] = source.input[0]
            folded[source.output[0]] = source
    removed = 0
    for name, node in folded.items():
        if name not in g.outputs and not any(name in n.input for n in model.graph.node):
            model.graph.node.remove(node)
            removed += 1
    return len(plan), removed
