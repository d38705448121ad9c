"""Lowering of ``Resize``: nearest resizing moves codes (``_movement``); linear resizing
(SegFormer's, MobileViT's and FPN decoders' bilinear upsampling: ``DequantizeLinear ->
Resize(mode=linear) -> QuantizeLinear``) is one ``resize_linear`` step.

ONNX's linear Resize, along each resized axis of length ``n_in -> n_out``: the source
coordinate ``x = coordinate(o)`` (``half_pixel``, ``pytorch_half_pixel``, ``align_corners``,
``asymmetric``: ``kernels._movement.COORDINATES``), clamped to ``[0, n_in - 1]``, and
``y[o] = (1 - f) v[i0] + f v[i1]`` with ``i0 = floor(x)``, ``i1 = min(i0 + 1, n_in - 1)``,
``f = x - i0``. The program holds ``w1 = round(f 2**F)`` per output position (exact for the
power-of-two scales of 2x / 4x upsampling: ``f`` in quarters / eighths; otherwise off by at
most ``2**-(F+1)`` of a neighbour difference), sums on centered codes in int64, and
requantizes once (one rounding, as ONNX Runtime's float Resize then QuantizeLinear). A float
result with a bound (MobileViT resizes a LayerNorm's output) is first realized on int16 codes
of ``bound / 32767`` (``_groupnorm.as_codes``).

Cubic (torch's bicubic ``F.interpolate``: ``cubic_coeff_a`` -0.75; -0.5 elsewhere) is one
``resize_cubic`` step: the source coordinate ``x`` is not clamped (as the ONNX reference and
ONNX Runtime), the four taps ``floor(x) - 1 .. floor(x) + 2`` are clamped to the axis (edge
values), their Keys weights of ``f = x - floor(x)`` (zeroed outside the axis and renormalized
with ``exclude_outside``) are computed in float64 and rounded to integers of ``2**F`` whose
sum is exactly ``2**F`` (the rounding residue goes to the largest weight: each weight is then
off by at most about ``2**-F``), then the same centered int64 sum and one requantization."""

from __future__ import annotations

import math

import numpy as np
import onnx

from ...numerics import fixed_point_multiplier
from .._program import QTensor
from ..kernels._movement import COORDINATES, resized_axes
from ._core import (
    Builder,
    LoweringError,
    Pending,
    QValue,
    Value,
    attrs_of,
    code_range,
    describe_node,
    node_name,
    register_lowering,
)
from ._groupnorm import as_codes
from ._movement import _movement, _resize_attrs

LINEAR_COORDINATES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric")
_nearest = _movement("resize_nearest", _resize_attrs)


def _text(a: dict, key: str, default: str) -> str:
    v = a.get(key, default)
    return v.decode() if isinstance(v, bytes) else v


def _cubic_tables(n_in: int, n_out: int, scale: float, mode: str, a: float, exclude: bool,
                  frac: int):  # fmt: skip
    """``(taps, weights)``, both ``(n_out, 4)``, of each output position along one axis."""
    x = COORDINATES[mode](np.arange(n_out, dtype=np.float64), scale, n_in, n_out)
    base = np.floor(x)
    d = np.abs(np.arange(-1.0, 3.0) - (x - base)[:, None])  # each tap's distance to x
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    w = np.where(d <= 1, near, np.where(d < 2, far, 0.0))
    taps = base.astype(np.int64)[:, None] + np.arange(-1, 3)
    if exclude:
        w = np.where((taps >= 0) & (taps < n_in), w, 0.0)
        w = w / w.sum(axis=1, keepdims=True)
    q = np.rint(w * 2.0**frac).astype(np.int64)
    largest = np.argmax(np.abs(q), axis=1)
    q[np.arange(n_out), largest] += 2**frac - q.sum(axis=1)
    return np.clip(taps, 0, n_in - 1), q


def _axis_tables(n_in: int, n_out: int, scale: float, mode: str, frac: int):
    """``(i0, i1, w1)`` of each output position along one axis."""
    o = np.arange(n_out, dtype=np.float64)
    x = np.clip(COORDINATES[mode](o, scale, n_in, n_out), 0, n_in - 1)
    i0 = np.floor(x).astype(np.int64)
    i1 = np.minimum(i0 + 1, n_in - 1)
    w1 = np.rint((x - i0) * 2.0**frac).astype(np.int64)
    return i0, i1, w1


@register_lowering("Resize")
def _resize(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    a = attrs_of(node)
    mode = _text(a, "mode", "nearest")
    if mode == "nearest":
        return _nearest(b, node, ins)
    coordinates = _text(a, "coordinate_transformation_mode", "half_pixel")
    antialias = a.get("antialias", 0)
    if mode not in ("linear", "cubic") or coordinates not in LINEAR_COORDINATES or antialias:
        raise LoweringError(
            f"{describe_node(node)}: mode={mode}, coordinate_transformation_mode={coordinates}"
            f"{', antialias' if antialias else ''}; lowered: nearest, and linear or cubic "
            f"without antialias with {list(LINEAR_COORDINATES)} (export "
            "F.interpolate(mode='bilinear' or 'bicubic', antialias=False), or mode='nearest')"
        )
    if a.get("axes") is not None or _text(a, "keep_aspect_ratio_policy", "stretch") != "stretch":
        raise LoweringError(f"{describe_node(node)}: axes / keep_aspect_ratio_policy not lowered")
    x = ins[0]
    if isinstance(x, Pending) and x.bound and math.isfinite(x.bound):
        x = as_codes(b, x)  # MobileViT: LayerNorm -> fold back -> Resize: int16 codes first
    if not isinstance(x, QValue) or x.tensor.bits > 16:
        raise LoweringError(
            f"{describe_node(node)}: a linear Resize is lowered on a quantized tensor "
            "(DequantizeLinear -> Resize -> QuantizeLinear); quantize its input (a "
            "QuantizeLinear in front of the Resize)"
        )
    t: QTensor = x.tensor
    shape = b.shapes.get(node.input[0])
    if shape is None or any(d is None for d in shape):
        raise LoweringError(f"{describe_node(node)}: the input shape must be static (got "
                            f"{shape}); pass lower(..., input_shapes=...)")  # fmt: skip
    attrs = _resize_attrs(node, ins, {**a, "mode": b"nearest"})  # scales / sizes
    resized = resized_axes(attrs, shape)
    if mode == "cubic":
        return [_cubic(b, node, t, resized, coordinates, a)]
    # int32 sums: |q - z| 2**(K F) < 2**31 for K resized axes (F = 11 for 8-bit codes, 7 for
    # int16 ones: a bounded float result, a LayerNorm's output, realized first)
    frac = (30 - code_range(t, t.zero_point).bit_length()) // max(1, len(resized))
    axes = tuple((axis, *_axis_tables(n_in, n_out, scale, coordinates, frac))
                 for axis, n_in, n_out, scale in resized)  # fmt: skip
    bound = code_range(t, t.zero_point) * 2 ** (frac * len(resized))
    return [_requantized(b, node, t, "resize_linear", axes, frac, bound, 1.0)]


def _cubic(b: Builder, node: onnx.NodeProto, t: QTensor, resized, coordinates: str, a: dict):
    """The ``resize_cubic`` step: ``F`` the largest (<= 12) that keeps the sums in int32 with
    the weights' negative lobes (``|acc| <= |q - z| prod_axes max_o sum_t |w|``)."""
    coeff = float(a.get("cubic_coeff_a", -0.75))
    exclude = bool(a.get("exclude_outside", 0))
    for frac in range(12, 0, -1):
        axes = tuple((axis, *_cubic_tables(n_in, n_out, scale, coordinates, coeff, exclude, frac))
                     for axis, n_in, n_out, scale in resized)  # fmt: skip
        gain = math.prod(int(np.abs(w).sum(axis=1).max()) for _, _, w in axes)
        bound = code_range(t, t.zero_point) * gain
        if bound < 2**31:
            break
    # the sum of |weights| bounds |y| / max |x| (cubic overshoots its neighbours)
    return _requantized(b, node, t, "resize_cubic", axes, frac, bound,
                        gain / 2.0 ** (frac * len(resized)))  # fmt: skip


def _requantized(b, node, t: QTensor, op: str, axes, frac: int, bound: int, gain: float):
    bits = b.check_accumulator(node_name(node), bound)
    name = node_name(node)

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        ratio = t.scale / out.scale / 2.0 ** (frac * len(axes))
        multiplier, shift = fixed_point_multiplier(ratio, bits)
        builder.step(op, name, [t], out, axes=axes, frac=frac, x_zero=t.zero_point,
                     multiplier=multiplier, shift=shift, out_zero=out.zero_point, qmin=qmin,
                     qmax=qmax, dtype=out.dtype)  # fmt: skip

    # |y| <= gain max |x|: 1 for an interpolation within its neighbours
    return Pending(name, realize, bound=gain * t.scale * code_range(t, t.zero_point))
