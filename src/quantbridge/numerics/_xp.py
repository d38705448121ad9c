"""Array-type dispatch: one implementation for numpy arrays and torch tensors.

The affine formulas are written once against a tiny common vocabulary that exists with the same
semantics in both libraries:

* ``xp.round``  -- round half to even (``np.round`` and ``torch.round`` both are),
* ``xp.clip``   -- ``np.clip`` / ``torch.clip`` (alias of ``torch.clamp``),
* ``xp.where``, ``xp.isnan``, and the ``/``, ``*``, ``+``, ``-`` operators.

``_xp(x)`` returns the ``torch`` module when ``x`` is a torch tensor and ``numpy`` otherwise.
torch is never imported here: a tensor can only exist if the caller already imported torch, so
``sys.modules.get("torch")`` is enough, and numpy-only users never pay for (or need) torch.
"""

from __future__ import annotations

import math
import sys
from types import ModuleType
from typing import Any

import numpy as np

Array = Any  # numpy.ndarray or torch.Tensor; kept loose so torch stays optional.


def _torch_of(x: object) -> ModuleType | None:
    """The torch module if ``x`` is a torch tensor, else None (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch
    return None


def _xp(x: object) -> ModuleType:
    """The array namespace of ``x``: the ``torch`` module for tensors, ``numpy`` otherwise."""
    return _torch_of(x) or np


def as_compute_float(x: object) -> Array:
    """``x`` as an array in the float dtype the affine math runs in.

    float64 stays float64, everything else (float32, float16, bfloat16, integers, bool) becomes
    float32. Python scalars and lists are read as float32, the dtype of ONNX tensors. Half
    precision is widened because float16 cannot hold every 16-bit integer code (its largest
    finite value is 65504) nor compute ``x / scale`` as ONNX Runtime does (in float32).
    """
    torch = _torch_of(x)
    if torch is not None:
        if x.dtype in (torch.float32, torch.float64):
            return x
        return x.to(torch.float32)
    if not isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x, dtype=np.float32)
    x = np.asarray(x)
    if x.dtype in (np.float32, np.float64):
        return x
    return x.astype(np.float32)


def as_like(value: object, like: Array) -> Array:
    """``value`` (scalar, list, numpy array or tensor) as an array of ``like``'s type and dtype."""
    torch = _torch_of(like)
    if torch is not None:
        return torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if _torch_of(value) is not None:
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=like.dtype)


def normalize_axis(axis: int, ndim: int) -> int:
    """``axis`` in ``[0, ndim)``; negative axes count from the end. ValueError when out of range."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis must be an int, got {axis!r} ({type(axis).__name__})")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {ndim}")
    return int(axis) % ndim


def broadcast_param(
    param: Array, name: str, shape: tuple[int, ...], axis: int | None, block_size: int | None = None
) -> Array:
    """Reshape a per-tensor (one element) or per-channel (1-D) parameter to broadcast with ``shape``.

    ``axis=None``: the parameter must hold exactly one element. ``axis=k``: the parameter holds
    one element (broadcast to every channel) or ``shape[k]`` elements, laid out along axis ``k``.
    ``block_size=B`` (with ``axis=k``): a blocked parameter, expanded by ``expand_blocks``.
    """
    if block_size is not None:
        if axis is None:
            raise ValueError(f"{name}: blocked parameters (block_size={block_size}) need an axis")
        return expand_blocks(param, name, shape, axis, block_size)
    size = math.prod(param.shape)
    if axis is None:
        if size != 1:
            raise ValueError(
                f"{name} has shape {tuple(param.shape)} but axis=None (per tensor); "
                "pass axis=<channel axis> for per-channel parameters"
            )
        return param.reshape(())
    axis = normalize_axis(axis, len(shape))
    if size == 1:
        return param.reshape(())
    if param.ndim != 1 or size != shape[axis]:
        raise ValueError(
            f"{name} has shape {tuple(param.shape)}; per-channel parameters along axis {axis} "
            f"of an array of shape {tuple(shape)} must be 1-D of length {shape[axis]}"
        )
    return param.reshape([-1 if i == axis else 1 for i in range(len(shape))])


def expand_blocks(
    param: Array, name: str, shape: tuple[int, ...], axis: int, block_size: int
) -> Array:
    """A blocked parameter repeated to the data's full ``shape`` (ONNX blocked quantization).

    The parameter has the data's rank; along ``axis`` it holds ``ceil(shape[axis] / B)`` blocks
    (the last one may be partial), along every other dimension the data's size. Element ``i`` of
    the data along ``axis`` uses block ``i // B``:

    .. math:: p_{full}[\\ldots, i, \\ldots] = p[\\ldots, \\lfloor i / B \\rfloor, \\ldots]

    An exact copy (no arithmetic). ValueError naming ``name`` when the shapes do not fit.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"{name}: block_size must be an int, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"{name}: block_size must be >= 1, got {block_size}")
    axis = normalize_axis(axis, len(shape))
    blocks = -(-shape[axis] // block_size)
    want = tuple(blocks if d == axis else n for d, n in enumerate(shape))
    if tuple(param.shape) != want:
        raise ValueError(
            f"{name} has shape {tuple(param.shape)}; blocked parameters of an array of shape "
            f"{tuple(shape)} with block_size {block_size} along axis {axis} must have shape {want}"
        )
    torch = _torch_of(param)
    if torch is not None:
        full = torch.repeat_interleave(param, block_size, dim=axis)
        return full.narrow(axis, 0, shape[axis])
    full = np.repeat(param, block_size, axis=axis)
    return full[tuple(slice(0, n) for n in shape)]
