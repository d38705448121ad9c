"""Data movement on integer codes: no arithmetic, the (scale, zero point) pass through.

Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Slice, Gather, GatherND and
GatherElements (constant indices),
nearest-neighbour Resize (a gather with index maps computed at lowering), Expand, Tile,
DepthToSpace / SpaceToDepth and Identity move codes without changing them, so they commute with
quantization exactly.
"""

from __future__ import annotations

import numpy as np

from ._registry import register_kernel

# kernels that are a pure index map (each output code is one input code): the emitters gather
# through the map the kernel computes on ``arange`` (besides transpose, slice, gather, resize)
INDEX_MAPPED = (
    "expand",
    "tile",
    "depth_to_space",
    "space_to_depth",
    "gather_nd",
    "gather_elements",
)


@register_kernel("reshape")
def reshape(attrs, x: np.ndarray) -> np.ndarray:
    shape = [x.shape[i] if d == 0 else d for i, d in enumerate(attrs["shape"])]
    return x.reshape(shape)


@register_kernel("flatten")
def flatten(attrs, x: np.ndarray) -> np.ndarray:
    # ONNX: axis in [-r, r]; axis = r flattens everything into the outer dimension (TorchScript
    # writes Flatten(axis=2) of a rank-2 mask for mask[:, None, None, :]): not ``axis % r``
    axis = attrs["axis"] + x.ndim if attrs["axis"] < 0 else attrs["axis"]
    return x.reshape(int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis:])))


def _contiguous(x: np.ndarray) -> np.ndarray:
    """A C-contiguous array of the same shape: ``np.ascontiguousarray`` makes a 0-d array 1-d
    (a Transpose of a scalar came out of the program as shape ``(1,)``), ``np.require`` does not."""
    return np.require(x, requirements="C")


@register_kernel("transpose")
def transpose(attrs, x: np.ndarray) -> np.ndarray:
    return _contiguous(x.transpose(attrs["perm"]))


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
    return _contiguous(x[tuple(index)])


COORDINATES = {
    "half_pixel": lambda i, scale, n_in, n_out: (i + 0.5) / scale - 0.5,
    "pytorch_half_pixel": lambda i, scale, n_in, n_out: (
        (i + 0.5) / scale - 0.5 if n_out > 1 else 0.0 * i
    ),
    "asymmetric": lambda i, scale, n_in, n_out: i / scale,
    "tf_half_pixel_for_nn": lambda i, scale, n_in, n_out: (i + 0.5) / scale,
    "align_corners": lambda i, scale, n_in, n_out: (
        i * (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0 * i
    ),
}
NEAREST = {
    "round_prefer_floor": lambda x: np.ceil(x - 0.5),
    "round_prefer_ceil": lambda x: np.floor(x + 0.5),
    "floor": np.floor,
    "ceil": np.ceil,
}


def resized_axes(attrs, shape) -> list[tuple[int, int, int, float]]:
    """``(axis, n_in, n_out, scale)`` of each axis an ONNX Resize changes (``sizes`` given:
    ``scale = n_out / n_in``; else ``n_out = floor(n_in * scale)``)."""
    out = []
    for axis, n_in in enumerate(shape):
        if attrs["sizes"] is not None:
            n_out = int(attrs["sizes"][axis])
            scale = n_out / n_in
        else:
            scale = float(attrs["scales"][axis])
            n_out = int(np.floor(n_in * scale))
        if not (n_out == n_in and scale == 1.0):
            out.append((axis, int(n_in), n_out, scale))
    return out


def resize_indices(attrs, shape: tuple[int, ...]) -> dict[int, np.ndarray]:
    """Source index of each output position along each resized axis (ONNX Resize, nearest):
    ``index = clip(nearest(coordinate(i)), 0, n_in - 1)``, coordinates in float64."""
    out = {}
    for axis, n_in, n_out, scale in resized_axes(attrs, shape):
        i = np.arange(n_out, dtype=np.float64)
        x = COORDINATES[attrs["coordinates"]](i, scale, n_in, n_out)
        out[axis] = np.clip(NEAREST[attrs["nearest_mode"]](x), 0, n_in - 1).astype(np.int64)
    return out


@register_kernel("resize_nearest")
def resize_nearest(attrs, x: np.ndarray) -> np.ndarray:
    """A gather along each resized axis (``resize_indices``)."""
    for axis, index in resize_indices(attrs, x.shape).items():
        x = np.take(x, index, axis=axis)
    return x


@register_kernel("gather")
def gather(attrs, x: np.ndarray) -> np.ndarray:
    """ONNX Gather with constant indices (negative ones count from the end, as np.take)."""
    return np.take(x, attrs["indices"], axis=attrs["axis"])


@register_kernel("gather_nd")
def gather_nd(attrs, x: np.ndarray) -> np.ndarray:
    """ONNX GatherND with constant indices and batch_dims 0: the last axis of ``indices``
    addresses the leading axes of ``x`` (negative indices count from the end)."""
    indices = attrs["indices"]
    return _contiguous(x[tuple(np.moveaxis(indices, -1, 0))])


@register_kernel("gather_elements")
def gather_elements(attrs, x: np.ndarray) -> np.ndarray:
    """ONNX GatherElements with constant indices (negative ones count from the end)."""
    axis = attrs["axis"] % x.ndim
    return _contiguous(np.take_along_axis(x, attrs["indices"] % x.shape[axis], axis=axis))


PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "edge", "wrap": "wrap"}


@register_kernel("pad")
def pad(attrs, x: np.ndarray) -> np.ndarray:
    """ONNX Pad on codes: ``pads`` (begins for every axis, then ends; non-negative), ``mode``
    constant (writing ``value``: the zero point, the code of 0), reflect, edge or wrap."""
    n = x.ndim
    widths = list(zip(attrs["pads"][:n], attrs["pads"][n:], strict=True))
    if attrs["mode"] == "constant":
        return np.pad(x, widths, constant_values=attrs["value"])
    return np.pad(x, widths, mode=PAD_MODES[attrs["mode"]])


@register_kernel("identity")
def identity(attrs, x: np.ndarray) -> np.ndarray:
    return x


@register_kernel("expand")
def expand(attrs, x: np.ndarray) -> np.ndarray:
    """ONNX Expand: numpy broadcasting of ``x`` and ``shape`` (either may be the larger)."""
    return np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(attrs["shape"]))).copy()


@register_kernel("tile")
def tile(attrs, x: np.ndarray) -> np.ndarray:
    return np.tile(x, tuple(attrs["repeats"]))


@register_kernel("depth_to_space")
def depth_to_space(attrs, x: np.ndarray) -> np.ndarray:
    """ONNX DepthToSpace (N, C, H, W) -> (N, C / b^2, H b, W b); ``mode`` DCR (depth-column-row,
    the default) or CRD (torch's ``pixel_shuffle``), as the ONNX operator spec writes them."""
    n, c, h, w = x.shape
    k = attrs["blocksize"]
    if attrs["mode"] == "DCR":
        y = x.reshape(n, k, k, c // k**2, h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, c // k**2, k, k, h, w).transpose(0, 1, 4, 2, 5, 3)
    return _contiguous(y.reshape(n, c // k**2, h * k, w * k))


@register_kernel("space_to_depth")
def space_to_depth(attrs, x: np.ndarray) -> np.ndarray:
    """ONNX SpaceToDepth (N, C, H, W) -> (N, C b^2, H / b, W / b) (the inverse of DCR)."""
    n, c, h, w = x.shape
    k = attrs["blocksize"]
    y = x.reshape(n, c, h // k, k, w // k, k).transpose(0, 3, 5, 1, 2, 4)
    return _contiguous(y.reshape(n, c * k**2, h // k, w // k))
