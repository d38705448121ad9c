"""Calibration data for an ONNX file: arrays keyed by graph input name, checked, in batches.

What ``quantize_onnx`` (and ``quantbridge quantize --calib``) accepts:

* an ``.npz`` file: one array per graph input, keyed by the input's ONNX name, samples on axis 0
  (``np.savez("calib.npz", x=images)`` for an input ``x`` of shape ``[N, 3, H, W]``);
* a folder of ``.npy`` / ``.npz`` files, read in name order: an ``.npz`` as above, an ``.npy``
  (models with one input only) the samples of that input. Samples of different files may differ
  in the file's dynamic dimensions (image sizes, sequence lengths); batches never mix files;
* in Python also a mapping ``{input name: array}`` (the ``.npz`` form).

Every array is checked against the graph input before the first forward pass, and each problem
is one line naming the array and the fix: an array for no input (the inputs are listed), an input
without an array, a wrong number of dimensions, a static dimension of another size, a dtype of
another kind (float input, integer array), no samples. Float arrays of any precision are cast to
the input's type (float32 for float32 inputs); integer and bool inputs (token ids, masks) take
arrays of their kind and pass through the model unquantized.

Batches hold ``batch_size`` samples (the last one fewer), and exactly the file's static batch size
when the first dimension of an input is static (then a remainder is dropped).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper

DEFAULT_BATCH_SIZE = 8


@dataclass(frozen=True)
class GraphInput:
    """One graph input: its name, element type and dimensions (int: static, str: symbolic,
    None: unknown)."""

    name: str
    dtype: np.dtype
    dims: tuple[int | str | None, ...]

    @property
    def is_float(self) -> bool:
        return np.issubdtype(self.dtype, np.floating)

    def describe(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.dims)
        return f"{self.name!r} {self.dtype}[{dims}]"


def graph_inputs(model: onnx.ModelProto) -> list[GraphInput]:
    """The graph inputs that are not initializers (older exporters list weights as inputs)."""
    inits = {i.name for i in model.graph.initializer}
    found = []
    for value in model.graph.input:
        if value.name in inits:
            continue
        t = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            raise ValueError(
                f"graph input {value.name!r} is not a tensor; quantize_onnx calibrates tensor "
                "inputs only"
            )
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type))
        # Paddle2ONNX writes dynamic dimensions as dim_value -1
        dims = tuple(d.dim_value if d.dim_value > 0 else (d.dim_param or None) for d in t.shape.dim)
        found.append(GraphInput(value.name, dtype, dims))
    return found


class CalibrationSet:
    """The calibration batches of one model: an iterable of tuples of tensors in graph-input
    order, with ``len`` (for the progress bar). Everything is checked at construction."""

    def __init__(self, source, inputs: list[GraphInput], batch_size: int | None = None):
        if not inputs:
            raise ValueError("the model has no graph inputs to calibrate")
        self.inputs = inputs
        self.batch_size = _batch_size(inputs, batch_size)
        self.parts = [_checked(where, arrays, inputs) for where, arrays in _parts(source, inputs)]
        if not self.parts:
            raise ValueError(f"calibration data {_name(source)}: no .npz or .npy files found")
        if len(self) == 0:
            raise ValueError(
                f"calibration data {_name(source)}: {self.samples} samples, fewer than the "
                f"model's fixed batch size {self.batch_size}"
            )

    @property
    def samples(self) -> int:
        return sum(len(next(iter(p.values()))) for p in self.parts)

    def __len__(self) -> int:
        n = 0
        for part in self.parts:
            count = len(next(iter(part.values())))
            n += count // self.batch_size if self._static_batch else -(-count // self.batch_size)
        return n

    @property
    def _static_batch(self) -> bool:
        return any(i.dims and isinstance(i.dims[0], int) for i in self.inputs)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for part in self.parts:
            count = len(next(iter(part.values())))
            stop = count - count % self.batch_size if self._static_batch else count
            for start in range(0, stop, self.batch_size):
                yield tuple(
                    torch.from_numpy(
                        np.ascontiguousarray(part[i.name][start : start + self.batch_size])
                    )
                    for i in self.inputs
                )

    def first(self) -> tuple[torch.Tensor, ...]:
        return next(iter(self))


def _batch_size(inputs: list[GraphInput], batch_size: int | None) -> int:
    static = {i.dims[0] for i in inputs if i.dims and isinstance(i.dims[0], int)}
    if len(static) > 1:
        raise ValueError(f"the model's inputs have different static batch sizes {sorted(static)}")
    if batch_size is not None and (isinstance(batch_size, bool) or int(batch_size) < 1):
        raise ValueError(f"batch_size={batch_size!r}: give a positive number of samples")
    if static:
        (fixed,) = static
        if batch_size is not None and batch_size != fixed:
            raise ValueError(
                f"batch_size={batch_size}: the model's batch dimension is fixed at {fixed}; "
                f"use batch_size={fixed}"
            )
        return fixed
    return int(batch_size) if batch_size is not None else DEFAULT_BATCH_SIZE


def _name(source) -> str:
    return repr(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else "mapping"


def _parts(source, inputs: list[GraphInput]) -> Iterator[tuple[str, Mapping[str, np.ndarray]]]:
    """(where, {name: array}) for each file (or the one mapping) of ``source``."""
    if isinstance(source, Mapping):
        yield "calibration data", source
        return
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            "calibration data must be a path (.npz file or folder of .npy/.npz) or a mapping "
            f"{{input name: array}}, got {type(source).__name__}"
        )
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".npz", ".npy") and p.is_file())
        for f in files:
            yield from _file(f, inputs)
    elif path.is_file():
        yield from _file(path, inputs)
    else:
        raise ValueError(f"calibration data {str(path)!r}: no such file or folder")


def _file(path: Path, inputs: list[GraphInput]) -> Iterator[tuple[str, Mapping[str, np.ndarray]]]:
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(
            f"calibration file {str(path)!r} is not a numpy .npy/.npz file: {e}"
        ) from None
    if isinstance(loaded, np.ndarray):
        if len(inputs) != 1:
            raise ValueError(
                f"calibration file {str(path)!r} is a .npy array, but the model has "
                f"{len(inputs)} inputs {[i.name for i in inputs]}; save one .npz keyed by "
                "input name instead"
            )
        yield str(path), {inputs[0].name: loaded}
        return
    with loaded:
        yield str(path), {k: loaded[k] for k in loaded.files}


def _checked(
    where: str, arrays: Mapping[str, np.ndarray], inputs: list[GraphInput]
) -> dict[str, np.ndarray]:
    names = [i.name for i in inputs]
    unknown = [k for k in arrays if k not in names]
    if unknown:
        raise ValueError(
            f"{where}: array {unknown[0]!r} is not an input of the model; the model's inputs "
            f"are {names}"
        )
    missing = [n for n in names if n not in arrays]
    if missing:
        raise ValueError(
            f"{where}: no array for input {missing[0]!r}; the model's inputs are {names} "
            f"(arrays found: {sorted(arrays)})"
        )
    out = {i.name: _checked_array(f"{where}[{i.name!r}]", arrays[i.name], i) for i in inputs}
    counts = {k: len(v) for k, v in out.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"{where}: the inputs hold different numbers of samples {counts}; give every input "
            "the same number along axis 0"
        )
    return out


def _checked_array(where: str, array, spec: GraphInput) -> np.ndarray:
    array = np.asarray(array)
    if array.ndim != len(spec.dims):
        raise ValueError(
            f"{where}: shape {list(array.shape)} does not fit input {spec.describe()}: expected "
            f"{len(spec.dims)} dimensions, samples on axis 0"
        )
    if array.shape[0] == 0:
        raise ValueError(f"{where}: holds no samples (shape {list(array.shape)})")
    for axis, (size, want) in enumerate(zip(array.shape[1:], spec.dims[1:], strict=True), 1):
        if isinstance(want, int) and size != want:
            raise ValueError(
                f"{where}: shape {list(array.shape)} does not fit input {spec.describe()}: "
                f"dimension {axis} is {size}, the model needs {want}"
            )
    return array.astype(_checked_dtype(where, array.dtype, spec), copy=False)


def _checked_dtype(where: str, dtype: np.dtype, spec: GraphInput) -> np.dtype:
    def kind(t: np.dtype) -> str:
        if t == np.bool_:
            return "bool"
        if np.issubdtype(t, np.floating):
            return "float"
        if np.issubdtype(t, np.integer):
            return "integer"
        return str(t)

    if kind(dtype) != kind(spec.dtype):
        raise ValueError(
            f"{where}: dtype {dtype} does not fit input {spec.describe()} ({kind(spec.dtype)} "
            f"values); convert it, e.g. array.astype(np.{spec.dtype})"
        )
    return spec.dtype
