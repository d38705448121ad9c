"""The op registry of ``import_onnx``: which torch code computes each ONNX op, per opset.

An entry (``OpHandler``) is keyed by op type and the opset that introduced its current form;
``lookup(op, opset)`` picks the newest form at or below the model's opset, so handlers never
branch on the opset (``Squeeze`` reads ``axes`` from an attribute before opset 13 and from an
input from 13 on: two entries). The entry says how the importer feeds the op:

* ``fn(node, *inputs)`` - the torch computation. Inputs are tensors, or numpy arrays for
  constants the importer passes as values: the ``static`` positions (shapes, axes, scales, clip
  bounds) and, for ``elementwise`` ops, size-1 constants that become python scalars (``x * 0.5``,
  as a hand-written model has them).
* ``host(node, *arrays)`` - the same op on numpy arrays, for shape arithmetic. Values computed
  from ``Shape`` are numpy arrays of python ints (or of ``SymInt`` under ``torch.export``), so a
  ``Shape -> Gather -> Concat -> Reshape`` chain hands ``reshape`` python sizes, never tensors.
* ``layer`` - ops whose constant weights become a real ``nn.Module`` (``LayerSpec``).
* ``check(node)`` - attribute validation at import time (a clear error instead of a wrong result).

An unknown op is an error that lists the registered ones (``supported_ops``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch


@dataclass
class OnnxNode:
    """One ONNX node as the handlers see it: decoded attributes, the opset of its domain, and
    the ranks of its inputs where shape inference knew them."""

    name: str
    op_type: str
    opset: int
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    ranks: tuple[int | None, ...] = ()
    domain: str = ""

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    def rank(self, i: int, value: Any = None) -> int | None:
        """Rank of input ``i``: shape inference's, else the value's own."""
        r = self.ranks[i] if i < len(self.ranks) else None
        if r is None and value is not None:
            r = value.ndim
        return r

    def where(self) -> str:
        return f"ONNX node {self.name!r} (op {self.op_type}, opset {self.opset})"


@dataclass(frozen=True)
class LayerSpec:
    """``build(node, consts) -> (module, consumed input positions) | None`` (None: the weights
    are not constants, the op runs functionally); ``call(node, module, *other_inputs)``."""

    build: Callable[[OnnxNode, dict[str, np.ndarray]], tuple[torch.nn.Module, tuple[int, ...]]]
    call: Callable[..., Any]


@dataclass(frozen=True)
class OpHandler:
    op_type: str
    since: int
    fn: Callable[..., Any]
    host: Callable[..., Any] | None = None
    static: tuple[int, ...] = ()
    elementwise: bool = False
    layer: LayerSpec | None = None
    check: Callable[[OnnxNode], None] | None = None
    always_host: bool = False  # Shape, Size: a tensor in, python sizes out

    def __reduce_ex__(self, protocol):
        """A registered handler pickles as its key (its functions may be closures)."""
        if any(e is self for e in _REGISTRY.get(self.op_type, ())):
            return _registered, (self.op_type, self.since)
        return super().__reduce_ex__(protocol)


_REGISTRY: dict[str, list[OpHandler]] = {}


def register(op_types: str | tuple[str, ...], since: int = 1, **options) -> Callable:
    """Decorator: ``fn`` computes ``op_types`` from opset ``since`` on (see ``OpHandler``)."""
    names = (op_types,) if isinstance(op_types, str) else op_types

    def decorate(fn: Callable) -> Callable:
        for name in names:
            entries = _REGISTRY.setdefault(name, [])
            if any(e.since == since for e in entries):
                raise AssertionError(f"{name} since {since} registered twice")
            entries.append(OpHandler(name, since, fn, **options))
            entries.sort(key=lambda e: e.since)
        return fn

    return decorate


def _registered(op_type: str, since: int) -> OpHandler:
    return next(e for e in _REGISTRY[op_type] if e.since == since)


def lookup(op_type: str, opset: int) -> OpHandler | None:
    """The newest form of ``op_type`` introduced at or before ``opset``."""
    found = None
    for entry in _REGISTRY.get(op_type, ()):
        if entry.since <= opset:
            found = entry
    return found


def supported_ops() -> list[str]:
    return sorted(_REGISTRY)


# -- helpers shared by the handlers --------------------------------------------------------------
_TORCH_DTYPES = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.BOOL: torch.bool,
}


def torch_dtype(onnx_type: int, node: OnnxNode) -> torch.dtype:
    if onnx_type not in _TORCH_DTYPES:
        name = onnx.TensorProto.DataType.Name(onnx_type)
        raise ValueError(f"{node.where()}: element type {name} has no torch equivalent here")
    return _TORCH_DTYPES[onnx_type]


def numpy_dtype(onnx_type: int) -> np.dtype:
    return onnx.helper.tensor_dtype_to_np_dtype(onnx_type)


def as_tensor(value: Any) -> Any:
    """A tensor for ``value`` (numpy constants and python-size arrays become tensors)."""
    if isinstance(value, np.ndarray):
        if value.dtype == object:  # sizes under torch.export: python ints and SymInts
            return torch.tensor(value.tolist(), dtype=torch.int64)
        # np.require keeps a 0-d array 0-d (np.ascontiguousarray makes it 1-d, so a scalar size
        # became shape (1,) in torch and its Unsqueeze (1, 1): EfficientViT, issue 12)
        value = np.require(value, requirements="C")
        return torch.from_numpy(value if value.flags.writeable else value.copy())
    if isinstance(value, (bool, int, float)):
        return torch.tensor(value)
    return value  # tensors, None, and torch.fx proxies


def operand(value: Any) -> Any:
    """An elementwise operand: a size-1 numpy constant is a python scalar, else a tensor."""
    if isinstance(value, np.ndarray) and value.size == 1 and value.dtype != object:
        return value.item()
    return as_tensor(value)


def ints(value: Any) -> list:
    """Python ints (or SymInts) from a constant, a size array or (data-dependent) a tensor."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    flat = np.asarray(value).reshape(-1).tolist()
    return [v if isinstance(v, torch.SymInt) else int(v) for v in flat]


def floats(value: Any) -> list[float]:
    if isinstance(value, torch.Tensor):
        return [float(v) for v in value.reshape(-1).tolist()]
    return [float(v) for v in np.asarray(value).reshape(-1).tolist()]


def size_array(values) -> np.ndarray:
    """A 1-D int64 array of sizes; an object array when some are SymInts (under export)."""
    values = list(values)
    if all(isinstance(v, (int, np.integer)) for v in values):
        return np.array(values, dtype=np.int64)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def normalize_axes(axes, rank: int) -> list[int]:
    return [a + rank if a < 0 else a for a in axes]
