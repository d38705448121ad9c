"""The integer-only program: typed integer tensors, a list of kernel steps, float boundaries.

Every tensor inside the program holds integer codes ``q`` meaning ``r = scale * (q - zero_point)``
(``QTensor``). Steps (``Step``) name a kernel of ``integer.kernels`` and carry its integer
parameters (weights, zero points, multipliers, shifts, tables); nothing inside is floating point.
Floats exist only at the boundary: ``run`` quantizes float inputs with the graph's input
QuantizeLinear parameters and dequantizes the outputs (unless integer outputs are asked for).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..numerics import dequantize, quantize
from .emit import emit_c, to_onnx
from .kernels import run_step


@dataclasses.dataclass(frozen=True)
class QTensor:
    """An integer tensor of the program: ``dtype`` codes with ``r = scale * (q - zero_point)``."""

    name: str
    dtype: np.dtype
    scale: float
    zero_point: int

    @property
    def qmin(self) -> int:
        return int(np.iinfo(self.dtype).min)

    @property
    def qmax(self) -> int:
        return int(np.iinfo(self.dtype).max)

    @property
    def bits(self) -> int:
        return np.dtype(self.dtype).itemsize * 8

    def fixed_point(self) -> dict[str, Any]:
        """The fixed-point format: ``fraction_bits = -log2(scale)``, exact when the scale is a
        power of two (then the tensor is ``ap_fixed<bits, bits - fraction_bits>`` after
        subtracting the zero point); otherwise the nearest fraction bits and the exact scale."""
        frac, exp = math.frexp(self.scale)
        exact = frac == 0.5
        fraction_bits = 1 - exp if exact else -math.log2(self.scale)
        return {
            "tensor": self.name,
            "dtype": np.dtype(self.dtype).name,
            "bits": self.bits,
            "signed": np.issubdtype(self.dtype, np.signedinteger),
            "scale": self.scale,
            "zero_point": self.zero_point,
            "fraction_bits": int(fraction_bits) if exact else round(fraction_bits, 3),
            "power_of_two": exact,
        }


@dataclasses.dataclass(frozen=True)
class Step:
    """One kernel call: ``output = kernels[op](attrs, *inputs)``; ``node`` is the ONNX node."""

    op: str
    node: str
    inputs: tuple[str, ...]
    output: str
    attrs: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Boundary:
    """A graph input or output: the ONNX name, the program tensor, and whether the ONNX value
    is float (quantized on the way in / dequantized on the way out) or the integer codes.

    ``table`` (outputs only, ``lower(..., float_outputs="dequantize")``): the float32 value of
    each code ``q`` at ``table[q - qmin]``, for an output that the ONNX graph computes in float
    from the codes (a final Sigmoid); the conversion happens outside the integer program.

    ``scale`` (outputs only, same option): for an output that a weighted layer (Conv, Gemm,
    MatMul) writes in float, the program outputs the layer's int32 accumulator (bias included)
    and ``scale`` is its float32 scale, one value or one per channel along ``axis`` (1 for Conv,
    -1 for MatMul / Gemm): ``real = scale * q``, computed in float64 and rounded to float32
    once, outside the integer program. ``tensor.scale`` is then the largest channel scale."""

    name: str
    tensor: QTensor
    is_float: bool
    table: np.ndarray | None = dataclasses.field(default=None, compare=False)
    scale: np.ndarray | None = dataclasses.field(default=None, compare=False)
    axis: int = -1

    def to_float(self, q: np.ndarray) -> np.ndarray:
        """The ONNX output's float value of the codes ``q``: the table, the accumulator scale,
        or dequantization."""
        if self.table is not None:
            return self.table[q.astype(np.int64) - self.tensor.qmin]
        if self.scale is not None:
            axis = self.axis if self.scale.size > 1 else None
            real = dequantize(q.astype(np.float64), self.scale.astype(np.float64), 0, axis)
            return np.asarray(real).astype(np.float32)
        return np.asarray(dequantize(q, self.tensor.scale, self.tensor.zero_point))


class IntegerProgram:
    """An integer-only program lowered from a QDQ ONNX model (``quantbridge.lower``)."""

    def __init__(
        self,
        inputs: list[Boundary],
        outputs: list[Boundary],
        steps: list[Step],
        tensors: dict[str, QTensor],
        constants: dict[str, np.ndarray],
        onnx_tensors: dict[str, str] | None = None,
        input_shapes: dict[str, tuple[int | None, ...]] | None = None,
    ):
        self.inputs = inputs
        self.outputs = outputs
        self.steps = steps
        self.tensors = tensors
        self.constants = constants
        # ONNX tensor name -> program tensor holding its codes (recorded by the lowering)
        self.onnx_tensors = dict(onnx_tensors or {})
        # ONNX input name -> its declared shape (None for a symbolic dimension)
        self.input_shapes = dict(input_shapes or {})

    def _feeds(self, inputs: Mapping[str, Any] | np.ndarray) -> dict[str, np.ndarray]:
        if not isinstance(inputs, Mapping):
            if len(self.inputs) != 1:
                names = [b.name for b in self.inputs]
                raise TypeError(f"the program has inputs {names}; pass a dict name -> array")
            inputs = {self.inputs[0].name: inputs}
        missing = [b.name for b in self.inputs if b.name not in inputs]
        if missing:
            raise ValueError(f"missing inputs {missing}; the program takes {self._input_names()}")
        env: dict[str, np.ndarray] = {}
        for b in self.inputs:
            x, t = np.asarray(inputs[b.name]), b.tensor
            if x.dtype == bool:  # a bool input (a mask) is held as uint8 0 / 1
                env[t.name] = x.astype(t.dtype)
            elif np.issubdtype(x.dtype, np.integer):
                if x.size and (x.min() < t.qmin or x.max() > t.qmax):
                    raise ValueError(f"input {b.name!r}: integer codes outside {t.dtype} range")
                env[t.name] = x.astype(t.dtype)
            else:
                q = quantize(x, t.scale, t.zero_point, t.qmin, t.qmax)
                env[t.name] = np.asarray(q).astype(t.dtype)
        return env

    def _input_names(self) -> list[str]:
        return [b.name for b in self.inputs]

    def run_integer(self, inputs: Mapping[str, Any] | np.ndarray) -> dict[str, np.ndarray]:
        """Every tensor of the program (integer codes), keyed by program tensor name."""
        env = dict(self.constants)
        env.update(self._feeds(inputs))
        for step in self.steps:
            env[step.output] = run_step(step, [env[i] for i in step.inputs])
        return env

    def run(
        self, inputs: Mapping[str, Any] | np.ndarray, *, integer: bool = False
    ) -> dict[str, np.ndarray]:
        """Execute in numpy (the reference executor). Float inputs are quantized with the graph's
        input QuantizeLinear parameters (integer arrays are taken as codes). Outputs, keyed by
        ONNX output name: float32 where the ONNX output is float (dequantized), codes where it
        is the integer tensor, or codes everywhere with ``integer=True``."""
        env = self.run_integer(inputs)
        out = {}
        for b in self.outputs:
            q = env[b.tensor.name]
            if b.is_float and not integer:
                out[b.name] = b.to_float(q)
            else:
                out[b.name] = q
        return out

    def tensor_shapes(
        self, input_shapes: Mapping[str, tuple[int, ...]] | None = None
    ) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape for concrete input shapes (default: the declared ones, symbolic
        dimensions set to 1), found by running the program once on zero codes."""
        feeds = {}
        for b in self.inputs:
            shape = (input_shapes or {}).get(b.name) or self.input_shapes.get(b.name)
            if shape is None:
                raise ValueError(f"input {b.name!r} has no static shape; pass input_shapes")
            feeds[b.name] = np.full([d or 1 for d in shape], b.tensor.zero_point, b.tensor.dtype)
        return {name: v.shape for name, v in self.run_integer(feeds).items()}

    def emit_c(
        self,
        directory: str | os.PathLike,
        input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> list[str]:
        """Write portable C99 (``qb_model.h``, ``qb_model.c``: static arrays, no malloc, no
        float) computing the same codes as ``run_integer``; returns the two paths."""
        return emit_c(self, directory, input_shapes)

    def to_onnx(self, input_shapes: Mapping[str, tuple[int, ...]] | None = None) -> Any:
        """The program as an integer-only ONNX ModelProto (ConvInteger, MatMulInteger, int64
        arithmetic, Gather tables): inputs and outputs are the boundary tensors' codes."""
        return to_onnx(self, input_shapes)

    def save_onnx(
        self, path: str | os.PathLike, input_shapes: Mapping[str, tuple[int, ...]] | None = None
    ) -> Any:
        """Write ``to_onnx(input_shapes)`` to ``path``; returns the ModelProto."""
        model = self.to_onnx(input_shapes)
        with open(path, "wb") as f:
            f.write(model.SerializeToString())
        return model

    def formats(self) -> list[dict[str, Any]]:
        """Each tensor's fixed-point format (``QTensor.fixed_point``), in program order."""
        return [t.fixed_point() for t in self.tensors.values()]

    def describe(self) -> str:
        """A table of every tensor's fixed-point format, for people who think in ap_fixed."""
        rows = [("tensor", "type", "scale", "zero_point", "fraction bits")]
        for f in self.formats():
            frac = str(f["fraction_bits"]) + ("" if f["power_of_two"] else " (not exact)")
            rows.append((f["tensor"], f["dtype"], f"{f['scale']:.6g}", str(f["zero_point"]), frac))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        head = f"integer program: {len(self.steps)} steps, {len(self.tensors)} tensors"
        return "\n".join([head, *lines])

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.steps:
            counts[s.op] = counts.get(s.op, 0) + 1
        return counts

    def __repr__(self) -> str:
        ins = ", ".join(b.name for b in self.inputs)
        outs = ", ".join(b.name for b in self.outputs)
        return f"IntegerProgram(({ins}) -> ({outs}), {len(self.steps)} steps {self.op_counts()})"
