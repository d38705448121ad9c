"""Shape and data-movement ops of ``import_onnx``: Shape, Reshape, Slice, Gather, Concat,
Transpose, Squeeze, Pad, Resize, ...

Each op has a torch form and, where shape arithmetic uses it, a numpy form (``host``) on arrays
of python sizes: ``Shape`` returns ``x.shape`` as such an array (``SymInt`` entries under
``torch.export`` with dynamic dimensions), and ``Gather``/``Slice``/``Concat``/``Cast``/arithmetic
on it stay python, so ``Reshape`` receives sizes, not tensors.

Semantics worth stating:

* ``Reshape``: a 0 copies the input's dimension unless ``allowzero=1`` (opset 14).
* ``Slice``: python slicing has ONNX's clamping rules; negative steps go through ``flip`` (torch
  tensors cannot be sliced backwards).
* ``Squeeze``/``Unsqueeze``/``Split``: ``axes``/``split`` are attributes before opset 13, inputs
  from 13 (``Split`` also takes ``num_outputs`` from 18).
* ``Resize``: mapped to ``F.interpolate`` only where the coordinate transform and rounding are
  the same; other combinations are refused at import with the supported list (``_RESIZE_MODES``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ._registry import (
    OnnxNode,
    as_tensor,
    floats,
    ints,
    normalize_axes,
    register,
    size_array,
)


# -- shape ---------------------------------------------------------------------------------------
@register("Shape", always_host=True)
def _shape(node, x):
    dims = list(x.shape)
    start, end = node.attr("start", 0), node.attr("end")
    return size_array(dims[start:end])


@register("Size", always_host=True)
def _size(node, x):
    return np.asarray(x.numel(), dtype=np.int64 if isinstance(x.numel(), int) else object)


def _reshape_dims(node, shape, input_shape) -> list:
    dims = ints(shape)
    if not node.attr("allowzero", 0):
        dims = [input_shape[i] if isinstance(d, int) and d == 0 else d for i, d in enumerate(dims)]
    return dims


def symbolic(sizes) -> bool:
    """Whether a list of sizes holds a ``SymInt`` (a dynamic dimension under ``torch.export``)."""
    return any(isinstance(v, torch.SymInt) for v in sizes)


def _host_reshape(node, x, shape):
    dims = _reshape_dims(node, shape, x.shape)
    if symbolic(dims):  # numpy would pin the symbolic size to the example's: stay in torch
        return _reshape(node, as_tensor(x), shape)
    return x.reshape(dims)


@register("Reshape", since=5, static=(1,), host=_host_reshape)
def _reshape(node, x, shape):
    return x.reshape(_reshape_dims(node, shape, x.shape))


@register("Flatten")
def _flatten(node, x):
    axis = node.attr("axis", 1)
    if axis == 1:
        return torch.flatten(x, 1)
    rank = node.rank(0, x)
    axis = normalize_axes([axis], rank)[0]
    if axis == 0:
        return x.reshape(1, -1)
    if axis == rank:  # ONNX allows axis = rank: (every element, 1)
        return x.reshape(-1, 1)
    return torch.flatten(x, axis).flatten(0, axis - 1)


@register("Transpose", host=lambda n, x: np.transpose(x, n.attr("perm")))
def _transpose(node, x):
    perm = node.attr("perm")
    if perm is None:
        perm = list(reversed(range(node.rank(0, x))))
    return x.permute(perm)


def _squeeze(node, x, axes=None):
    axes = ints(axes) if axes is not None else node.attr("axes")
    if isinstance(x, np.ndarray):
        return np.squeeze(x, tuple(normalize_axes(axes, x.ndim))) if axes else np.squeeze(x)
    return x.squeeze(tuple(axes)) if axes else x.squeeze()


def _unsqueeze(node, x, axes=None):
    axes = ints(axes) if axes is not None else node.attr("axes")
    rank = (x.ndim if isinstance(x, np.ndarray) else node.rank(0, x)) + len(axes)
    for a in sorted(normalize_axes(axes, rank)):
        x = np.expand_dims(x, a) if isinstance(x, np.ndarray) else x.unsqueeze(a)
    return x


register("Squeeze", since=1, host=_squeeze)(_squeeze)
register("Squeeze", since=13, host=_squeeze, static=(1,))(_squeeze)
register("Unsqueeze", since=1, host=_unsqueeze)(_unsqueeze)
register("Unsqueeze", since=13, host=_unsqueeze, static=(1,))(_unsqueeze)


@register("Concat", host=lambda n, *xs: np.concatenate(xs, axis=n.attr("axis")))
def _concat(node, *xs):
    return torch.cat([as_tensor(x) for x in xs], node.attr("axis"))


def _split(node, x, split=None):
    axis = node.attr("axis", 0)
    sizes = ints(split) if split is not None else node.attr("split")
    if sizes:
        return tuple(torch.split(x, sizes, axis))
    parts = node.attr("num_outputs", len(node.outputs))
    return tuple(torch.chunk(x, parts, axis))


register("Split", since=2)(_split)
register("Split", since=13, static=(1,))(_split)


def _slices(node, x_rank, starts, ends, axes, steps) -> tuple[list, list[int]]:
    """Python slices per dimension, and the axes to flip first (negative steps)."""
    starts, ends = ints(starts), ints(ends)
    axes = ints(axes) if axes is not None and len(np.asarray(axes).reshape(-1)) else None
    axes = normalize_axes(axes if axes else list(range(len(starts))), x_rank)
    steps = ints(steps) if steps is not None and len(np.asarray(steps).reshape(-1)) else None
    steps = steps or [1] * len(starts)
    index = [slice(None)] * x_rank
    for a, s, e, st in zip(axes, starts, ends, steps, strict=True):
        index[a] = slice(s, e, st)
    return index


def _slice_tensor(x, index: list):
    """``x[index]`` for torch tensors; a negative step slices the flipped tensor."""
    for axis, sl in enumerate(index):
        if sl.step is not None and sl.step < 0:
            n = x.shape[axis]
            lo, hi, step = slice(sl.start, sl.stop, sl.step).indices(int(n))  # clamped as ONNX
            x = x.flip(axis)
            index[axis] = slice(n - 1 - lo, n - 1 - hi, -step)
    return x[tuple(index)]


@register(
    "Slice",
    since=1,
    host=lambda n, x: x[
        tuple(_slices(n, x.ndim, n.attr("starts"), n.attr("ends"), n.attr("axes"), None))
    ],
)
def _slice_attributes(node, x):
    rank = node.rank(0, x)
    return _slice_tensor(
        x, _slices(node, rank, node.attr("starts"), node.attr("ends"), node.attr("axes"), None)
    )


def _host_slice(node, x, starts, ends, axes=None, steps=None):
    return x[tuple(_slices(node, x.ndim, starts, ends, axes, steps))]


@register("Slice", since=10, static=(1, 2, 3, 4), host=_host_slice)
def _slice(node, x, starts, ends, axes=None, steps=None):
    return _slice_tensor(x, _slices(node, node.rank(0, x), starts, ends, axes, steps))


def _host_gather(node, data, indices):
    return np.take(data, np.asarray(indices, dtype=np.int64), axis=node.attr("axis", 0))


@register("Gather", host=_host_gather, static=(1,))
def _gather(node, data, indices):
    axis = node.attr("axis", 0)
    if isinstance(indices, np.ndarray):  # constant indices: select / index_select
        n = data.shape[axis]
        if indices.ndim == 0:
            return data.select(axis, int(indices))
        flat = [int(i) for i in indices.reshape(-1)]
        flat = [i + n if i < 0 else i for i in flat]
        picked = data.index_select(axis, torch.tensor(flat, dtype=torch.int64))
        shape = list(data.shape[:axis]) + list(indices.shape) + list(data.shape[axis + 1 :])
        return picked.reshape(shape)
    data = as_tensor(data)  # an embedding table (a constant) read at input-dependent indices
    n = data.shape[axis]
    indices = torch.where(indices < 0, indices + n, indices)
    picked = data.index_select(axis, indices.reshape(-1))
    return picked.reshape(data.shape[:axis] + indices.shape + data.shape[axis + 1 :])


@register("GatherElements", since=11)
def _gather_elements(node, data, indices):
    axis = node.attr("axis", 0)
    data, indices = as_tensor(data), as_tensor(indices)  # either may be computed on the host
    indices = torch.where(indices < 0, indices + data.shape[axis], indices)
    return torch.gather(data, axis, indices)


def _broadcast_to(input_shape, shape) -> list:
    """ONNX Expand's output shape: bidirectional broadcast of ``input_shape`` and ``shape``."""
    rank = max(len(input_shape), len(shape))
    a = [1] * (rank - len(input_shape)) + list(input_shape)
    b = [1] * (rank - len(shape)) + list(shape)
    return [x if isinstance(y, int) and y == 1 else y for x, y in zip(a, b, strict=True)]


def _host_expand(node, x, shape):
    dims = _broadcast_to(x.shape, ints(shape))
    if symbolic(dims):  # a constant expanded to [batch, 1, D] (class token): a torch expand
        return _expand(node, x, shape)
    return np.broadcast_to(x, dims)


@register("Expand", since=8, static=(1,), host=_host_expand)
def _expand(node, x, shape):
    return as_tensor(x).expand(_broadcast_to(x.shape, ints(shape)))


@register("Tile", since=6, static=(1,))
def _tile(node, x, repeats):
    return x.repeat(ints(repeats))


def _fill_value(node) -> np.ndarray:
    value = node.attr("value")
    return np.zeros(1, np.float32) if value is None else value.reshape(-1)


def _host_constant_of_shape(node, shape):
    """Small concrete shapes (the ``[1, 1, 1]`` of legacy ``expand(B, -1, -1)``) in numpy, so
    the ``Equal``/``Where`` shape arithmetic after them stays on python sizes."""
    dims = ints(shape)
    if symbolic(dims) or int(np.prod(dims)) > _HOST_ELEMENTS:
        return _constant_of_shape(node, shape)
    value = _fill_value(node)
    return np.full(dims, value[0], dtype=value.dtype)


_HOST_ELEMENTS = 64  # size arrays are this small; a larger fill is a tensor op


@register("ConstantOfShape", since=9, static=(0,), host=_host_constant_of_shape)
def _constant_of_shape(node, shape):
    value = _fill_value(node)
    return torch.full(ints(shape), value[0].item(), dtype=as_tensor(value).dtype)


@register("Range", since=11, static=(0, 1, 2))
def _range(node, start, limit, delta):
    dtype = as_tensor(np.asarray(start)).dtype if isinstance(start, np.ndarray) else start.dtype
    values = [
        v.item() if isinstance(v, torch.Tensor) else np.asarray(v).item()
        for v in (start, limit, delta)
    ]
    return torch.arange(*values, dtype=dtype)


# -- pad -----------------------------------------------------------------------------------------
_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


def _check_pad(node: OnnxNode) -> None:
    mode = node.attr("mode", "constant")
    if mode not in _PAD_MODES:
        raise ValueError(
            f"{node.where()}: mode {mode!r} is not supported; use one of {list(_PAD_MODES)}"
        )


def torch_pads(rank: int, pads, axes=None) -> list:
    """``F.pad``'s list (last dimension first, down to the first padded one) for ONNX ``pads``
    (all begins, then all ends) over ``axes``; empty when nothing is padded. A symbolic amount
    counts as padded (testing it for zero would guard on, and pin, the size it comes from)."""
    pads = ints(pads)
    half = len(pads) // 2
    axes = normalize_axes(ints(axes), rank) if axes is not None else list(range(rank - half, rank))
    begin = dict(zip(axes, pads[:half], strict=True))
    end = dict(zip(axes, pads[half:], strict=True))
    padded = lambda v: not isinstance(v, int) or v != 0  # noqa: E731
    first = min((a for a in axes if padded(begin[a]) or padded(end[a])), default=rank)
    out: list = []
    for a in reversed(range(first, rank)):
        out += [begin.get(a, 0), end.get(a, 0)]
    return out


def _pad(node, x, pads, value=0.0, axes=None):
    amounts = torch_pads(node.rank(0, x), pads, axes)
    if not amounts:
        return x
    mode = _PAD_MODES[node.attr("mode", "constant")]
    if mode != "constant":
        return F.pad(x, amounts, mode=mode)
    fill = floats(value) if value is not None else []  # constant_value may be left empty ("")
    return F.pad(x, amounts, value=fill[0] if fill else 0.0)


@register("Pad", since=2, check=_check_pad)
def _pad_attributes(node, x):
    return _pad(node, x, node.attr("pads"), np.asarray([node.attr("value", 0.0)]))


register("Pad", since=11, static=(1, 2, 3), check=_check_pad)(_pad)


@register("DepthToSpace", since=1)
def _depth_to_space(node, x):
    b = node.attr("blocksize")
    n, c, h, w = x.shape
    if node.attr("mode", "DCR") == "CRD":
        return F.pixel_shuffle(x, b)
    y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    return y.reshape(n, c // (b * b), h * b, w * b)


# -- resize --------------------------------------------------------------------------------------
# (mode, coordinate_transformation_mode, nearest_mode or None) -> (torch mode, align_corners).
# The transforms agree exactly: torch 'nearest' is floor(dst * in/out) = asymmetric + floor;
# 'nearest-exact' is floor((dst + 0.5) * in/out) = half_pixel + round_prefer_ceil; linear and
# cubic with align_corners=False are half_pixel (pytorch_half_pixel differs only for an output
# length of 1, checked at run time), with align_corners=True align_corners.
_RESIZE_MODES = {
    ("nearest", "asymmetric", "floor"): ("nearest", None),
    ("nearest", "half_pixel", "round_prefer_ceil"): ("nearest-exact", None),
    ("nearest", "pytorch_half_pixel", "round_prefer_ceil"): ("nearest-exact", None),
    ("linear", "half_pixel", None): ("linear", False),
    ("linear", "pytorch_half_pixel", None): ("linear", False),
    ("linear", "align_corners", None): ("linear", True),
    ("cubic", "half_pixel", None): ("bicubic", False),
    ("cubic", "pytorch_half_pixel", None): ("bicubic", False),
    ("cubic", "align_corners", None): ("bicubic", True),
}
_LINEAR = {1: "linear", 2: "bilinear", 3: "trilinear"}


def _resize_mode(node: OnnxNode) -> tuple[str, bool | None]:
    mode = node.attr("mode", "nearest")
    transform = node.attr("coordinate_transformation_mode", "half_pixel")
    nearest = node.attr("nearest_mode", "round_prefer_floor") if mode == "nearest" else None
    key = (mode, transform, nearest)
    problems = []
    if key not in _RESIZE_MODES:
        problems.append(
            f"mode={mode!r}, coordinate_transformation_mode={transform!r}"
            + (f", nearest_mode={nearest!r}" if nearest else "")
        )
    if mode == "cubic" and (
        node.attr("cubic_coeff_a", -0.75) != -0.75 or node.attr("exclude_outside", 0)
    ):
        problems.append("cubic_coeff_a other than -0.75 or exclude_outside=1")
    if node.attr("antialias", 0):
        problems.append("antialias=1")
    if (
        node.attr("keep_aspect_ratio_policy", "stretch") != "stretch"
        or node.attr("axes") is not None
    ):
        problems.append("axes / keep_aspect_ratio_policy")
    if problems:
        supported = "; ".join(f"{m}/{t}" + (f"/{n}" if n else "") for m, t, n in _RESIZE_MODES)
        raise ValueError(
            f"{node.where()}: {', '.join(problems)} has no exact torch.nn.functional.interpolate "
            f"equivalent; supported (mode/coordinate_transformation_mode/nearest_mode): "
            f"{supported}. Re-export the model with one of these, or resize outside the import"
        )
    return _RESIZE_MODES[key]


def _resize(node, x, roi=None, scales=None, sizes=None):
    mode, align = _resize_mode(node)
    rank = node.rank(0, x)
    spatial = rank - 2
    if mode == "linear":
        mode = _LINEAR[spatial]
    if sizes is not None and len(np.asarray(sizes).reshape(-1)):
        dims = ints(sizes)
        if list(dims[:2]) != list(x.shape[:2]):
            raise ValueError(
                f"{node.where()}: resizing the batch or channel dimension is not supported"
            )
        kwargs = {"size": dims[2:]}
    else:
        factors = floats(scales)
        if factors[:2] != [1.0, 1.0]:
            raise ValueError(
                f"{node.where()}: scales {factors} resize the batch or channel dimension; not supported"
            )
        kwargs = {"scale_factor": factors[2:]}
    if align is not None:
        kwargs["align_corners"] = align
    y = F.interpolate(x, mode=mode, **kwargs)
    if node.attr("coordinate_transformation_mode") == "pytorch_half_pixel":
        if any(isinstance(d, int) and d == 1 for d in y.shape[2:]):
            raise ValueError(
                f"{node.where()}: pytorch_half_pixel with an output length of 1 samples the "
                "first pixel, which no torch interpolation mode does; use half_pixel"
            )
    return y


def _check_resize(node: OnnxNode) -> None:
    _resize_mode(node)


register("Resize", since=11, static=(1, 2, 3), check=_check_resize)(_resize)


def _check_upsample(node: OnnxNode) -> None:
    if node.attr("mode", "nearest") != "nearest":
        raise ValueError(
            f"{node.where()}: {node.op_type} mode {node.attr('mode')!r} (asymmetric coordinates) "
            "has no torch equivalent; only mode='nearest' is supported. Re-export with opset >= 11 "
            "(Resize with a coordinate_transformation_mode)"
        )


# Resize-10 is Upsample-9 renamed: (x, scales), asymmetric coordinates, nearest = floor, the
# output size floor(size * scale); ORT's Resize-10 equals F.interpolate(nearest) bit for bit
@register("Resize", since=10, static=(1,), check=_check_upsample)
@register("Upsample", since=9, static=(1,), check=_check_upsample)
def _upsample(node, x, scales):
    factors = floats(scales)
    return F.interpolate(x, scale_factor=factors[2:], mode="nearest")


@register("Upsample", since=7, check=_check_upsample)
def _upsample_attributes(node, x):
    return F.interpolate(x, scale_factor=node.attr("scales")[2:], mode="nearest")
