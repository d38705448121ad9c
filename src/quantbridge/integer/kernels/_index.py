"""Integer and bool arithmetic on the model's own integer tensors (attention masks, position
ids, token ids): not codes of real values but the integers themselves (scale 1, zero point 0),
so every step is exact. Bools are uint8 0 / 1.

``logic``   Not / And / Or / Xor (``attrs["fn"]``), numpy broadcasting   -> uint8 0 / 1
``compare`` Equal / Less / LessOrEqual / Greater / GreaterOrEqual       -> uint8 0 / 1
``arith``   Add / Sub / Mul (``attrs["fn"]``) in the output dtype (wrapping, as ONNX integers)
``where``   ``cond != 0 ? a : b``, cast to the output dtype (``a``, ``b`` of that dtype)
``cast``    to ``dtype``; to bool (``logical``): ``x != 0``
``cumsum``  along ``axis``, ``exclusive`` / ``reverse`` as ONNX CumSum, in the input dtype
``take``    ``data`` gathered by run-time ``indices`` along ``axis`` (negative ones count from
            the end): an embedding table's codes looked up by token ids
"""

from __future__ import annotations

import numpy as np

from ._registry import register_kernel

LOGIC = {"Not": np.logical_not, "And": np.logical_and, "Or": np.logical_or,
         "Xor": np.logical_xor}  # fmt: skip
COMPARE = {"Equal": np.equal, "Less": np.less, "LessOrEqual": np.less_equal,
           "Greater": np.greater, "GreaterOrEqual": np.greater_equal}  # fmt: skip


@register_kernel("logic")
def logic(attrs, *inputs: np.ndarray) -> np.ndarray:
    return np.asarray(LOGIC[attrs["fn"]](*(x != 0 for x in inputs)), np.uint8)


@register_kernel("compare")
def compare(attrs, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray(COMPARE[attrs["fn"]](a.astype(np.int64), b.astype(np.int64)), np.uint8)


ARITH = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}


@register_kernel("arith")
def arith(attrs, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dtype = attrs["dtype"]
    return np.asarray(ARITH[attrs["fn"]](a.astype(dtype), b.astype(dtype)), dtype)


@register_kernel("where")
def where(attrs, cond: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray(np.where(cond != 0, a, b), attrs["dtype"])


@register_kernel("cast")
def cast(attrs, x: np.ndarray) -> np.ndarray:
    if attrs["logical"]:
        return np.asarray(x != 0, np.uint8)
    return np.asarray(x, attrs["dtype"])


@register_kernel("cumsum")
def cumsum(attrs, x: np.ndarray) -> np.ndarray:
    axis = attrs["axis"]
    y = np.flip(x, axis) if attrs["reverse"] else x
    s = np.cumsum(y, axis=axis, dtype=x.dtype)
    if attrs["exclusive"]:
        s = s - y
    return np.ascontiguousarray(np.flip(s, axis) if attrs["reverse"] else s)


@register_kernel("take")
def take(attrs, data: np.ndarray, indices: np.ndarray) -> np.ndarray:
    return np.take(data, indices.astype(np.int64), axis=attrs["axis"])


@register_kernel("arg_extreme")
def arg_extreme(attrs, x: np.ndarray) -> np.ndarray:
    """ArgMax / ArgMin (``attrs["fn"]``) along ``axis`` as int64, the first index of the
    extreme or, with ``last``, the last (ONNX ``select_last_index``)."""
    axis = attrs["axis"] % x.ndim
    y = x.astype(np.int64) * (1 if attrs["fn"] == "ArgMax" else -1)
    if attrs["last"]:
        i = y.shape[axis] - 1 - np.argmax(np.flip(y, axis), axis=axis)
    else:
        i = np.argmax(y, axis=axis)
    return np.asarray(np.expand_dims(i, axis) if attrs["keepdims"] else i, np.int64)


@register_kernel("int_concat")
def int_concat(attrs, *inputs: np.ndarray) -> np.ndarray:
    """Concat of integer tensors (CLIP's ``[arange(B), argmax]`` index pairs), in ``dtype``."""
    return np.concatenate([x.astype(attrs["dtype"]) for x in inputs], axis=attrs["axis"])


@register_kernel("take_nd")
def take_nd(attrs, data: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """GatherND (batch_dims 0) by run-time indices: the last axis of ``indices`` addresses the
    leading axes of ``data`` (negative indices count from the end)."""
    idx = indices.astype(np.int64)
    m = idx.shape[-1]
    idx = idx % np.asarray(data.shape[:m], np.int64)
    return np.ascontiguousarray(data[tuple(np.moveaxis(idx, -1, 0))])
