"""The L2 norm of a quantized tensor (ReduceL2 of codes) as a symbolic value, ``L2Norm``.

It is a ``Pending`` with a bound (``s sqrt(N) max |q - z|``), realized where a QuantizeLinear (or
a float op, on int16 codes) reads it by the ``l2_norm`` step (``kernels._divide``); a Clip /
Relu after it (``F.normalize``'s ``clamp_min(eps)``) narrows ``lo`` and an Expand keeps it an
``L2Norm``, so that ``Div(x, expand(clamp_min(||x||, eps)))`` is seen whole and lowered as one
``l2_normalize`` step (``_divide``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx

from ...numerics import fixed_point_multiplier
from .._program import QTensor
from ._core import Builder, LoweringError, Pending, code_range, describe_node, node_name


@dataclasses.dataclass(frozen=True)
class L2Norm(Pending):
    """``||x||`` over ``axes`` (non-negative, keepdims as given) of the codes of ``source``
    (``n`` elements per row); ``lo`` > 0 after a ``clamp_min(eps)``."""

    source: QTensor | None = None
    axes: tuple[int, ...] = ()
    n: int = 0
    keepdims: bool = True


def root_shift(node: onnx.NodeProto, x: QTensor, n: int) -> tuple[int, int]:
    """``(k, S2_max)``: the largest ``k`` with ``S2 4**k < 2**62`` for every row of ``n`` codes."""
    width = code_range(x, x.zero_point)
    s2_max = n * width * width
    if s2_max.bit_length() > 61:
        raise LoweringError(f"{describe_node(node)}: {n} elements of {x.bits}-bit codes overflow "
                            "the int64 sum of squares")  # fmt: skip
    return (61 - s2_max.bit_length()) // 2, s2_max


def l2_norm_value(b: Builder, node: onnx.NodeProto, x: QTensor, axes: list[int],
                  keepdims: bool) -> L2Norm:  # fmt: skip
    """``ReduceL2(x)`` over ``axes`` (static sizes) of a program tensor, pending its grid."""
    rank = len(b.shapes.get(node.input[0]) or ())
    if not rank:
        raise LoweringError(f"{describe_node(node)}: the input's rank is unknown")
    axes = sorted(ax % rank for ax in axes)
    dims = [b.dim(node.input[0], ax) for ax in axes]
    if any(d is None for d in dims):
        raise LoweringError(f"{describe_node(node)}: the L2 norm's axes {axes} need static "
                            "sizes; export with static shapes or pass lower(..., input_shapes=)")  # fmt: skip
    n = int(np.prod(dims))
    k, s2_max = root_shift(node, x, n)
    name = node_name(node)

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        bits = 61 - 31  # R < 2**31
        multiplier, shift = fixed_point_multiplier(x.scale / (2.0**k * out.scale), bits)
        builder.step("l2_norm", name, [x], out, axes=tuple(axes), keepdims=keepdims,
                     x_zero=x.zero_point, k=k, multiplier=multiplier, shift=shift,
                     out_zero=out.zero_point, qmin=qmin, qmax=qmax, dtype=out.dtype)  # fmt: skip

    bound = x.scale * math.sqrt(s2_max)
    return L2Norm(name, realize, bound=bound, source=x, axes=tuple(axes), n=n, keepdims=keepdims)
