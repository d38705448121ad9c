"""Data movement on integer codes: no arithmetic, the (scale, zero point) pass through.

Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Slice, nearest-neighbour Resize (a gather
with index maps computed at lowering) and Identity move codes without changing them, so they
commute with quantization exactly.
"""

from __future__ import annotations

import numpy as np

from . import register_kernel


@register_kernel("reshape")
def reshape(attrs, x: np.ndarray) -> np.ndarray:
    shape = [x.shape[i] if d == 0 else d for i, d in enumerate(attrs["shape"])]
    return x.reshape(shape)


@register_kernel("flatten")
def flatten(attrs, x: np.ndarray) -> np.ndarray:
    axis = attrs["axis"] % x.ndim if x.ndim else 0
    return x.reshape(int(np.prod(x.shape[:axis])), -1)


@register_kernel("transpose")
def transpose(attrs, x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(attrs["perm"]))


@register_kernel("squeeze")
def squeeze(attrs, x: np.ndarray) -> np.ndarray:
    axes = attrs["axes"]
    if axes is None:
        return x.reshape([d for d in x.shape if d != 1])
    return np.squeeze(x, axis=tuple(a % x.ndim for a in axes))


@register_kernel("unsqueeze")
def unsqueeze(attrs, x: np.ndarray) -> np.ndarray:
    rank = x.ndim + len(attrs["axes"])
    return np.expand_dims(x, tuple(a % rank for a in attrs["axes"]))


@register_kernel("slice")
def slice_(attrs, x: np.ndarray) -> np.ndarray:
    """ONNX Slice: its clamping of starts and ends (either step sign) is Python's slicing."""
    index = [slice(None)] * x.ndim
    for start, end, axis, step in zip(
        attrs["starts"], attrs["ends"], attrs["axes"], attrs["steps"], strict=True
    ):
        index[axis % x.ndim] = slice(int(start), int(end), int(step))
    return np.ascontiguousarray(x[tuple(index)])


@register_kernel("resize_nearest")
def resize_nearest(attrs, x: np.ndarray) -> np.ndarray:
    """Gather along each resized axis with the precomputed source indices."""
    for axis, index in attrs["indices"].items():
        x = np.take(x, index, axis=axis)
    return x


@register_kernel("identity")
def identity(attrs, x: np.ndarray) -> np.ndarray:
    return x
