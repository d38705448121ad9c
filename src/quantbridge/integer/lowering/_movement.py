"""Lowering of ops that commute with quantization: data movement (Reshape, Flatten, Transpose,
Squeeze, Unsqueeze, Slice, Split (one Slice per output), nearest Resize, Expand, Tile,
DepthToSpace, SpaceToDepth, Identity, Dropout, Pad with zeros or copies) and MaxPool; and
``Shape`` of a tensor whose shape is static (``lower(..., input_shapes=...)``), a constant.

``moved`` applies one such op to any symbolic value: a program tensor gets a movement step
(same scale and zero point), a constant (an integer initializer, or a float one such as a
shape computation or a ViT's class token before its QuantizeLinear) is folded now, a pending
kernel result is
requantized first and moved after (the same codes, since requantization is elementwise and
monotone; a weighted layer's accumulator moves too, for a float graph output),
and a float function of one tensor moves its source.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx

from .._program import Boundary, QTensor
from ..kernels import KERNELS
from ..kernels._movement import COORDINATES, PAD_MODES
from ._core import (
    Accumulator,
    Builder,
    Const,
    Elementwise,
    FloatInput,
    IndexValue,
    IntInput,
    LoweringError,
    Pending,
    QConst,
    QValue,
    Value,
    attrs_of,
    describe_node,
    index_input,
    node_name,
    quantize_real,
    register_lowering,
)
from ._groupnorm import Normalized, reshaped
from ._l2 import L2Norm
from ._qdq import rescale_sum, table_step

_FLAT_ORDER = ("reshape", "flatten", "squeeze", "unsqueeze", "identity")  # keep the flat order


def moved(b: Builder, node: onnx.NodeProto, v: Value | None, op: str, attrs: dict) -> Value:
    name = node_name(node)
    if isinstance(v, Normalized) and op in _FLAT_ORDER:  # a group norm's Reshape back
        moved_shape = KERNELS[op](attrs, np.broadcast_to(np.int8(0), v.shape)).shape
        return reshaped(v, name, moved_shape)
    if isinstance(v, IntInput):  # an integer graph input (a mask): moved as integers
        v = index_input(b, v)
    if isinstance(v, QValue | IndexValue):
        out = b.like(node.output[0], v.tensor)
        b.step(op, name, [v.tensor], out, **attrs)
        return QValue(out, v.integer) if isinstance(v, QValue) else IndexValue(out, v.logical)
    if isinstance(v, QConst):
        return _fold(node, v, op, attrs)
    if isinstance(v, Const):
        return Const(KERNELS[op](attrs, v.array))
    if isinstance(v, Elementwise):
        out = b.like(node.output[0], v.source)
        b.step(op, name, [v.source], out, **attrs)
        return Elementwise(out, v.fn, v.node)
    if isinstance(v, Pending):
        inner = v

        def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
            before = builder.like(out.name + "_before_" + op, out)
            inner.realize(builder, before, qmin, qmax)
            builder.step(op, name, [before], out, **attrs)

        if isinstance(v, L2Norm) and op in ("expand", "identity"):  # F.normalize's expand_as
            return dataclasses.replace(v, realize=realize)  # a Div broadcasts it the same
        return Pending(
            v.node, realize, v.lo, v.hi, v.bound, _moved_accumulator(b, node, v, op, attrs)
        )
    if isinstance(v, FloatInput):  # input -> Transpose -> QuantizeLinear: quantize, then move

        def realize_input(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
            codes = builder.like(v.name, out)
            builder.inputs.append(Boundary(v.name, codes, True))
            builder.step(op, name, [codes], out, **attrs)

        return Pending(name, realize_input)
    raise LoweringError(f"{describe_node(node)}: input is not quantized (no DequantizeLinear)")


def _moved_accumulator(
    b: Builder, node: onnx.NodeProto, v: Pending, op: str, attrs: dict
) -> Accumulator | None:
    """A weighted layer's accumulator moved by a data-movement op (a Linear's output reshaped),
    for a float graph output: one scale moves as it is; per-channel scales follow the channel
    axis (``_channel_map``), or the accumulator is dropped (the output is then refused).
    MaxPool is excluded: the integer ONNX MaxPool has no int32 form; ReduceMax / ReduceMin too
    (a reduction over the channel axis would mix channel scales)."""
    acc = v.accumulator
    if acc is None or op in ("maxpool", "reduce_max", "reduce_min"):
        return None
    scale, axis = acc.scale, acc.axis
    if np.unique(scale).size > 1:
        mapped = _channel_map(b.shapes.get(node.input[0]), acc, op, attrs)
        if mapped is None:
            return None
        axis, channels = mapped
        scale = np.asarray(scale).reshape(-1)[channels]
    name = node_name(node)

    def write(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        before = builder.like(out.name + "_before_" + op, out)
        acc.write(builder, before, qmin, qmax)
        builder.step(op, name, [before], out, **attrs)

    return Accumulator(scale, axis, acc.bound, write)


def _channel_map(shape, acc: Accumulator, op: str, attrs: dict) -> tuple[int, np.ndarray] | None:
    """Where the channels go: the movement kernel run on each element's channel index, once
    with every unknown dimension 1 and once 2 (a reshape that mixes the batch into the channels
    then disagrees). ``(axis, channel at each position along it)``, or None when the channel
    index does not vary along one axis only."""
    if not shape:
        return None
    found = []
    for fill in (1, 2):
        dims = tuple(fill if d is None else d for d in shape)
        axis = acc.axis % len(dims)
        size = np.asarray(acc.scale).size
        if dims[axis] != size:
            return None
        index = np.arange(size).reshape([-1 if i == axis else 1 for i in range(len(dims))])
        try:
            moved = KERNELS[op](attrs, np.broadcast_to(index, dims).copy())
        except Exception:  # noqa: BLE001 - a move the map cannot follow leaves the output refused
            return None
        found.append(_varying_axis(moved))
    if found[0] is None or found[1] is None or found[0][0] != found[1][0]:
        return None
    if not np.array_equal(found[0][1], found[1][1]):
        return None
    return found[0]


def _varying_axis(m: np.ndarray) -> tuple[int, np.ndarray] | None:
    """``(k, m along axis k)`` when ``m`` is constant along every other axis, else None."""
    for k in range(m.ndim):
        line = m[tuple(slice(None) if i == k else 0 for i in range(m.ndim))]
        shape = [-1 if i == k else 1 for i in range(m.ndim)]
        if m.size and np.array_equal(m, np.broadcast_to(line.reshape(shape), m.shape)):
            return k, line
    return None


def _fold(node: onnx.NodeProto, v: QConst, op: str, attrs: dict) -> QConst:
    """Constant folding of a movement on an integer initializer (e.g. DQ -> Transpose -> MatMul)."""
    q = KERNELS[op](attrs, v.q)
    if v.axis is None:
        return QConst(q, v.scale, v.zero_point, None)
    if op == "transpose":
        perm = attrs["perm"] or tuple(reversed(range(v.q.ndim)))
        return QConst(q, v.scale, v.zero_point, list(perm).index(v.axis % v.q.ndim))
    raise LoweringError(f"{describe_node(node)}: {op} of a per-channel constant is not lowered")


def _ints(node: onnx.NodeProto, v: Value | None, what: str) -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, Const):
        raise LoweringError(f"{describe_node(node)}: {what} must be a constant")
    return [int(i) for i in np.asarray(v.array).reshape(-1)]


def _movement(op: str, make_attrs):
    def handler(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
        return [moved(b, node, ins[0], op, make_attrs(node, ins, attrs_of(node)))]

    return handler


def _reshape_attrs(node, ins, a) -> dict[str, Any]:
    shape = tuple(_ints(node, ins[1], "shape"))
    if a.get("allowzero", 0) and 0 in shape:  # allowzero only changes the meaning of a 0
        raise LoweringError(f"{describe_node(node)}: allowzero=1 with a 0 in the shape")
    return {"shape": shape}


def _const_indices(node, v: Value | None) -> np.ndarray:
    """Gather on codes with constant indices (torch's ``x[0]``, ``unbind`` of q, k, v)."""
    if not isinstance(v, Const) or not np.issubdtype(v.array.dtype, np.integer):
        raise LoweringError(f"{describe_node(node)}: only constant integer indices are lowered")
    return v.array.astype(np.int64)


def _axes(node, ins, a) -> dict[str, Any]:
    axes = _ints(node, ins[1], "axes") if len(ins) > 1 else a.get("axes")
    return {"axes": None if axes is None else tuple(axes)}


def _slice_attrs(node, ins, a) -> dict[str, Any]:
    if len(ins) > 1:
        starts, ends = _ints(node, ins[1], "starts"), _ints(node, ins[2], "ends")
        axes = _ints(node, ins[3], "axes") if len(ins) > 3 else None
        steps = _ints(node, ins[4], "steps") if len(ins) > 4 else None
    else:
        starts, ends, axes, steps = a["starts"], a["ends"], a.get("axes"), None
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    return {
        "starts": tuple(starts),
        "ends": tuple(ends),
        "axes": tuple(axes),
        "steps": tuple(steps),
    }


def _resize_attrs(node, ins, a) -> dict[str, Any]:
    def text(key: str, default: str) -> str:
        v = a.get(key, default)
        return v.decode() if isinstance(v, bytes) else v

    # Resize-10 is (x, scales) only, Upsample's semantics: asymmetric coordinates, floor; from
    # opset 11 on, scales is input 2 (after roi) and the attributes say how
    opset10 = len(node.input) == 2
    mode, coordinates = (
        text("mode", "nearest"),
        "asymmetric" if opset10 else text("coordinate_transformation_mode", "half_pixel"),
    )
    nearest = "floor" if opset10 else text("nearest_mode", "round_prefer_floor")
    if mode != "nearest" or coordinates not in COORDINATES or a.get("antialias", 0):
        raise LoweringError(
            f"{describe_node(node)}: mode={mode}, coordinate_transformation_mode={coordinates}; "
            f"only nearest resizing with {sorted(COORDINATES)} moves codes exactly"
        )
    if a.get("axes") is not None or text("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise LoweringError(f"{describe_node(node)}: axes / keep_aspect_ratio_policy not lowered")
    scales = ins[1] if opset10 else ins[2] if len(ins) > 2 else None
    sizes = _ints(node, ins[3], "sizes") if len(ins) > 3 and ins[3] is not None else None
    scale_list = None
    if sizes is None:
        if not isinstance(scales, Const):
            raise LoweringError(f"{describe_node(node)}: scales or sizes must be constants")
        scale_list = tuple(float(s) for s in np.asarray(scales.array).reshape(-1))
    return {"scales": scale_list, "sizes": None if sizes is None else tuple(sizes),
            "coordinates": coordinates, "nearest_mode": nearest}  # fmt: skip


def _depth_attrs(node, ins, a) -> dict[str, Any]:
    mode = a.get("mode", "DCR")
    return {
        "blocksize": int(a["blocksize"]),
        "mode": mode.decode() if isinstance(mode, bytes) else mode,
    }


MOVEMENTS = {
    "Reshape": ("reshape", _reshape_attrs),
    "Flatten": ("flatten", lambda n, i, a: {"axis": int(a.get("axis", 1))}),
    "Transpose": ("transpose", lambda n, i, a: {"perm": tuple(a["perm"]) if "perm" in a else None}),
    "Squeeze": ("squeeze", _axes),
    "Unsqueeze": ("unsqueeze", _axes),
    "Slice": ("slice", _slice_attrs),
    "GatherElements": (
        "gather_elements",
        lambda n, i, a: {"indices": _const_indices(n, i[1]), "axis": int(a.get("axis", 0))},
    ),
    "Expand": ("expand", lambda n, i, a: {"shape": tuple(_ints(n, i[1], "shape"))}),
    "Tile": ("tile", lambda n, i, a: {"repeats": tuple(_ints(n, i[1], "repeats"))}),
    "DepthToSpace": ("depth_to_space", _depth_attrs),
    "SpaceToDepth": ("space_to_depth", lambda n, i, a: {"blocksize": int(a["blocksize"])}),
    "Identity": ("identity", lambda n, i, a: {}),
    "Dropout": ("identity", lambda n, i, a: {}),
}
for _op, (_kernel, _attrs) in MOVEMENTS.items():
    register_lowering(_op)(_movement(_kernel, _attrs))


@register_lowering("Pad")
def _pad(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """Padding of a quantized tensor with a constant (the zero point's code, or the code of any
    value on its grid) or copies (reflect / edge / wrap): its grid, its codes moved (what
    ``qb.export`` writes for a zero pad). A constant off the grid (EfficientViT's LiteMLA pads
    ``v`` with 1) is padded after the QuantizeLinear that reads the Pad: ``Q(pad(x, c)) =
    pad(Q(x), Q(c))``, quantization being elementwise."""
    mode = attrs_of(node).get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    v, pads = ins[0], _ints(node, ins[1], "pads") if len(ins) > 1 else None
    constant = ins[2] if len(ins) > 2 else None
    if len(ins) > 3 and ins[3] is not None:
        raise LoweringError(f"{describe_node(node)}: Pad with axes is not lowered")
    if pads is None or any(p < 0 for p in pads) or mode not in PAD_MODES:
        raise LoweringError(
            f"{describe_node(node)}: only non-negative constant pads in mode constant, reflect, "
            f"edge or wrap are lowered (got pads={pads}, mode={mode!r})"
        )
    pads = tuple(int(p) for p in pads)
    fill = _fill(node, constant) if mode == "constant" else 0.0
    if isinstance(v, Elementwise):  # SEW: GELU -> Pad (a graph output, or its QuantizeLinear)
        if mode != "constant" or fill == 0.0:
            with np.errstate(all="ignore"):
                at_zero = float(np.asarray(v.fn(np.zeros(1)), np.float64).reshape(-1)[0])
            if mode != "constant" or at_zero == 0.0:  # f(0) = 0: pad the source with code z
                attrs = {"pads": pads, "mode": mode, "value": int(v.source.zero_point)}
                return [moved(b, node, v, "pad", attrs)]
        v = tabled(v)
    if isinstance(v, Pending | FloatInput):
        return [_pad_before_quantize(node, v, pads, mode, fill)]
    if not isinstance(v, QValue):
        raise LoweringError(f"{describe_node(node)}: the padded tensor must be integer codes")
    value = v.tensor.zero_point  # the code of 0 (also for Q -> Pad with no constant: as before)
    if mode == "constant" and constant is not None and fill != (value if v.integer else 0.0):
        code = _code_of(v, fill)
        if code is None:  # off the grid: the QuantizeLinear that reads the Pad quantizes it
            return [_pad_before_quantize(node, _requantized(v), pads, mode, fill)]
        value = code
    attrs = {"pads": pads, "mode": mode, "value": int(value)}
    return [moved(b, node, v, "pad", attrs)]


def _fill(node: onnx.NodeProto, constant: Value | None) -> float:
    """A constant Pad's value as a real number, 0 when absent; a code (Q -> Pad: an integer
    constant) is given as it stands, and read against the codes by ``_code_of``."""
    if constant is None:
        return 0.0
    if not isinstance(constant, Const) or np.asarray(constant.array).size != 1:
        raise LoweringError(
            f"{describe_node(node)}: the pad value must be one constant (got {constant!r})"
        )
    return float(np.asarray(constant.array).reshape(-1)[0])


def _code_of(v: QValue, fill: float) -> int | None:
    """The code that ``fill`` pads: itself for codes (Q -> Pad), else the code whose float32
    dequantization (ONNX Runtime's DQ) is exactly ``fill``; None when ``fill`` is off the grid."""
    t = v.tensor
    if v.integer:  # Q -> Pad: the constant is a code
        return int(fill) if fill == int(fill) and t.qmin <= fill <= t.qmax else None
    code = int(round(fill / t.scale)) + t.zero_point
    exact = np.float32(code - t.zero_point) * np.float32(t.scale) == np.float32(fill)
    return code if exact and t.qmin <= code <= t.qmax else None


def _requantized(v: QValue) -> Pending:
    """Codes on another grid: requantized by the QuantizeLinear that reads them."""
    name = v.tensor.name

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        rescale_sum(builder, name + "_requantized", [v.tensor], out, qmin, qmax)

    return Pending(name, realize)


def tabled(v: Elementwise) -> Pending:
    """A float function of 8-bit codes as the table that its QuantizeLinear will make."""

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        table_step(builder, v.node, v.source, v.fn, out, qmin, qmax)

    return Pending(v.node, realize)


def _pad_before_quantize(
    node: onnx.NodeProto, v: Pending | FloatInput, pads: tuple[int, ...], mode: str, fill: float
) -> Pending:
    """``Pad -> QuantizeLinear`` of a float result or a float graph input (a ZeroPad2d before
    the first quantizer, HF EfficientNet's stem; a LayerNorm output padded to whole windows,
    Swin; LiteMLA's ``pad(v, value=1)``): quantize, then pad the codes. Exact, because
    quantization is elementwise: a padded ``c`` goes through a Relu / Clip between the Pad and
    the QuantizeLinear to the code ``clamp(quantize(c), qmin, qmax)``, which the pad writes
    (quantization is monotone, so clamping before or after it is the same)."""
    name = node_name(node)

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        if isinstance(v, FloatInput):
            before = builder.like(v.name, out)
            builder.inputs.append(Boundary(v.name, before, True))
        else:
            before = builder.like(out.name + "_before_pad", out)
            v.realize(builder, before, qmin, qmax)
        value = min(max(quantize_real(fill, out), qmin), qmax)
        builder.step("pad", name, [before], out, pads=pads, mode=mode, value=int(value))

    if isinstance(v, FloatInput):
        return Pending(name, realize)
    return Pending(v.node, realize, v.lo, v.hi, v.bound)


@register_lowering("Split")
def _split(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """One ``slice`` per output (``torch.chunk`` / ``split``: q, k, v of a fused projection)."""
    a = attrs_of(node)
    axis = int(a.get("axis", 0))
    sizes = _ints(node, ins[1], "split") if len(ins) > 1 and ins[1] is not None else a.get("split")
    if sizes is None:
        n, parts = b.dim(node.input[0], axis), len(node.output)
        if n is None:
            raise LoweringError(f"{describe_node(node)}: the split axis {axis} has no static size")
        chunk = -(-n // parts)  # ONNX num_outputs: equal chunks, the last one smaller
        sizes = [min(chunk, max(0, n - i * chunk)) for i in range(parts)]
    ends = np.cumsum(sizes).tolist()
    outs = []
    for i, (output, end) in enumerate(zip(node.output, ends, strict=True)):
        part = onnx.helper.make_node(
            "Slice", [node.input[0]], [output], name=f"{node_name(node)}_{i}"
        )
        attrs = {"starts": (end - sizes[i],), "ends": (end,), "axes": (axis,), "steps": (1,)}
        outs.append(moved(b, part, ins[0], "slice", attrs))
    return outs


@register_lowering("Shape")
def _shape(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """The shape of a tensor whose dimensions are all static (shape inference from the graph's
    input shapes): a constant that the shape arithmetic after it (Gather, Concat, Expand's
    target ...) folds. ``start`` / ``end`` slice it (opset 15), clamped as Python's slicing."""
    shape = b.shapes.get(node.input[0])
    if isinstance(ins[0], Const):  # folded shape arithmetic (a Range) shape inference missed
        shape = ins[0].array.shape
    if shape is None or any(d is None for d in shape):
        raise LoweringError(
            f"{describe_node(node)}: the shape of {node.input[0]!r} is not static "
            f"({shape}); lower with input_shapes={{name: shape}} (`--input-shape` on the CLI)"
        )
    a = attrs_of(node)
    start, end = a.get("start", 0), a.get("end")
    return [Const(np.asarray(shape[start:end], np.int64))]
