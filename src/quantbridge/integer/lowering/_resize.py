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
of ``bound / 32767`` (``_groupnorm.as_codes``)."""

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
    if mode != "linear" or coordinates not in LINEAR_COORDINATES or a.get("antialias", 0):
        raise LoweringError(
            f"{describe_node(node)}: mode={mode}, coordinate_transformation_mode={coordinates}"
            f"{', antialias' if a.get('antialias', 0) else ''}; lowered: nearest, and linear "
            f"without antialias with {list(LINEAR_COORDINATES)} (export "
            "F.interpolate(mode='bilinear', antialias=False), or mode='nearest')"
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
    # int32 sums: |q - z| 2**(K F) < 2**31 for K resized axes (F = 11 for 8-bit codes, 7 for
    # int16 ones: a bounded float result, a LayerNorm's output, realized first)
    frac = (30 - code_range(t, t.zero_point).bit_length()) // max(1, len(resized))
    axes = tuple((axis, *_axis_tables(n_in, n_out, scale, coordinates, frac))
                 for axis, n_in, n_out, scale in resized)  # fmt: skip
    bound = code_range(t, t.zero_point) * 2 ** (frac * len(resized))
    bits = b.check_accumulator(node_name(node), bound)
    name = node_name(node)

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        ratio = t.scale / out.scale / 2.0 ** (frac * len(resized))
        multiplier, shift = fixed_point_multiplier(ratio, bits)
        builder.step("resize_linear", name, [t], out, axes=axes, frac=frac, x_zero=t.zero_point,
                     multiplier=multiplier, shift=shift, out_zero=out.zero_point, qmin=qmin,
                     qmax=qmax, dtype=out.dtype)  # fmt: skip

    # |y| <= max |x|: an interpolation stays within its neighbours
    return [Pending(name, realize, bound=t.scale * code_range(t, t.zero_point))]
