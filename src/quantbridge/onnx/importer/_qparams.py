"""Quantization parameters read from a quantized ONNX file, validated, and the grid they imply.

``FileQParams`` is one scale / zero point pair as the file writes it (QuantizeLinear,
DequantizeLinear, the operands of a QLinear op): float32 scale, integer zero point, the integer
type's grid ``[qmin, qmax]`` (narrowed by a ``Q -> Clip -> DQ``), the axis of a per-channel pair.
Bad values are refused here, with the node and the fix: zero, negative or non-finite scales, zero
points outside the type's range, integer types quantbridge has no scheme for.

Blocked parameters (opset 21 ``DequantizeLinear(block_size=B)``, ONNX Runtime's ``MatMulNBits``):
scale and zero point have the data's rank with ``ceil(n / B)`` blocks along ``axis``
(``block_size`` set, granularity ``PerBlock``). Their scales may be negative (nonzero and finite):
ONNX Runtime's symmetric block quantizer writes ``scale = absmax_signed / -8`` so that the value
of largest magnitude lands on code -8; a positive scale could not hold that code.

``scheme()`` is the ``QScheme`` whose grid is exactly ``[qmin, qmax]``: the quantizer of the
imported model then saturates where ONNX Runtime does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from ...numerics import PerBlock, PerChannel, PerTensor, QScheme

TensorProto = onnx.TensorProto

# ONNX integer element type -> (bits, signed) of the codes QuantizeLinear writes
INTEGER_TYPES = {
    TensorProto.INT8: (8, True),
    TensorProto.UINT8: (8, False),
    TensorProto.INT16: (16, True),
    TensorProto.UINT16: (16, False),
    TensorProto.INT4: (4, True),
    TensorProto.UINT4: (4, False),
}
_NUMPY_TYPES = {
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int16): TensorProto.INT16,
    np.dtype(np.uint16): TensorProto.UINT16,
    np.dtype(np.int32): TensorProto.INT32,
}


def onnx_type_of(array: np.ndarray) -> int | None:
    """ONNX element type of a numpy array read from a file (INT4/UINT4 through ml_dtypes)."""
    name = str(array.dtype)
    if name == "int4":
        return TensorProto.INT4
    if name == "uint4":
        return TensorProto.UINT4
    return _NUMPY_TYPES.get(np.dtype(array.dtype))


def type_range(onnx_type: int) -> tuple[int, int]:
    bits, signed = INTEGER_TYPES[onnx_type]
    return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)


@dataclass(frozen=True)
class FileQParams:
    """Scale and zero point of one quantized tensor, as a file holds them."""

    scale: np.ndarray  # float32, () per tensor or (C,) per channel
    zero_point: np.ndarray  # int64, same shape as scale
    onnx_type: int  # ONNX element type of the codes
    qmin: int
    qmax: int
    axis: int | None  # per-channel axis (None: per tensor)
    where: str  # the node that wrote them, for messages
    block_size: int | None = None  # blocked along ``axis`` (scale has the data's rank)

    @property
    def bits(self) -> int:
        return INTEGER_TYPES[self.onnx_type][0]

    @property
    def signed(self) -> bool:
        return INTEGER_TYPES[self.onnx_type][1]

    def same_grid(self, other: FileQParams) -> bool:
        """Same scale, zero point and axis (the integer range may have been narrowed)."""
        return (
            self.scale.shape == other.scale.shape
            and np.array_equal(self.scale, other.scale)
            and np.array_equal(self.zero_point, other.zero_point)
            and (self.axis == other.axis or self.scale.size == 1)
            and self.block_size == other.block_size
        )

    def narrowed(self, lo: int, hi: int, where: str) -> FileQParams:
        lo, hi = max(self.qmin, int(lo)), min(self.qmax, int(hi))
        if lo > hi:
            raise ValueError(f"{where}: clips the integers to an empty range [{lo}, {hi}]")
        outside = (self.zero_point < lo) | (self.zero_point > hi)
        if outside.any():
            raise ValueError(
                f"{where}: zero point {self.zero_point[outside][:4].tolist()} of {self.where} lies "
                f"outside the clipped range [{lo}, {hi}]; the zero point must be a code of the "
                "range (clip around it, or use a zero point inside the range)"
            )
        return FileQParams(
            self.scale, self.zero_point, self.onnx_type, lo, hi, self.axis, self.where,
            self.block_size,
        )  # fmt: skip

    def scheme(self) -> QScheme:
        """The scheme whose grid is exactly ``[qmin, qmax]``; ValueError when none is."""
        granularity = PerTensor() if self.axis is None else PerChannel(self.axis)
        if self.block_size is not None:
            granularity = PerBlock(self.axis, self.block_size)
        for bits in range(2, 17):
            for signed in (self.signed, not self.signed):
                for narrow in (False, True):
                    s = QScheme(bits, signed, self._symmetric(signed, bits), narrow, granularity)
                    if (s.qmin, s.qmax) == (self.qmin, self.qmax):
                        return s
        raise ValueError(
            f"{self.where}: integer range [{self.qmin}, {self.qmax}] is not the grid of any "
            "quantbridge scheme (2..16 bits, signed or unsigned, full or narrow range); clip to "
            "such a range (e.g. [0, 15], [-8, 7], [-127, 127]) or leave the tensor unclipped"
        )

    def _symmetric(self, signed: bool, bits: int) -> bool:
        middle = 0 if signed else 2 ** (bits - 1)
        return bool((self.zero_point == middle).all())


def read_qparams(
    where: str,
    scale: np.ndarray | None,
    zero_point: np.ndarray | None,
    axis: int | None,
    rank: int | None,
    output_type: int | None = None,
    block_size: int | None = None,
) -> FileQParams:
    """Validated parameters of a Q / DQ / QLinear operand (``where`` names the node and input);
    ``block_size``: blocked parameters (see the module docstring)."""
    if scale is None:
        raise ValueError(
            f"{where}: the scale is computed at run time; quantbridge imports constant scales "
            "(initializers or Constant nodes) only"
        )
    scale = np.asarray(scale)
    if not np.issubdtype(scale.dtype, np.floating):
        raise ValueError(f"{where}: scale has element type {scale.dtype}; expected float32")
    if scale.dtype != np.float32:
        raise ValueError(
            f"{where}: scale is {scale.dtype}; quantbridge imports float32 scales (convert the "
            "file's scales to float32)"
        )
    if block_size:
        return _blocked(where, scale, zero_point, axis, rank, output_type, int(block_size))
    if scale.ndim > 1:
        raise ValueError(
            f"{where}: scale has shape {scale.shape}; a scale of rank > 1 needs blocked "
            "quantization (a block_size attribute); otherwise per-tensor or per-channel only"
        )
    bad = ~(np.isfinite(scale) & (scale > 0))
    if bad.any():
        signed = bool(np.isfinite(scale).all() and (scale != 0).all())
        raise ValueError(
            f"{where}: scale {scale.reshape(-1)[bad.reshape(-1)][:4].tolist()} is not positive "
            "and finite; every scale must be > 0 (re-quantize the model, or replace the scale)"
            + (
                ". Negative per-channel scales are what NNCF's compress_weights writes in its "
                "symmetric mode (mode=INT8_SYM: the extreme weight of each row on code -128): "
                "compress with mode=INT8_ASYM, or import the float model"
                if signed
                else ""
            )
        )
    zero_point, onnx_type, lo, hi = _zero_point(where, scale, zero_point, output_type)
    if scale.size == 1:  # one element: per tensor, whatever the axis says
        scale, zero_point, axis = scale.reshape(()), zero_point.reshape(()), None
    elif axis is not None and rank is not None:
        axis = axis + rank if axis < 0 else axis
    return FileQParams(scale, zero_point, onnx_type, lo, hi, axis, where)


def _blocked(where, scale, zero_point, axis, rank, output_type, block_size) -> FileQParams:
    """Blocked parameters: nonzero finite scales of the data's rank, an axis, ``block_size``."""
    if block_size < 1:
        raise ValueError(f"{where}: block_size {block_size} must be >= 1")
    bad = ~(np.isfinite(scale) & (scale != 0))
    if bad.any():
        raise ValueError(
            f"{where}: scale {scale.reshape(-1)[bad.reshape(-1)][:4].tolist()} is zero or not "
            "finite; every block's scale must be nonzero and finite (re-quantize the model)"
        )
    if rank is not None and scale.ndim != rank:
        raise ValueError(
            f"{where}: blocked scale has rank {scale.ndim} but the data has rank {rank}; "
            "ONNX blocked quantization needs the same rank"
        )
    axis = 1 if axis is None else axis
    axis = axis + scale.ndim if axis < 0 else axis
    zero_point, onnx_type, lo, hi = _zero_point(where, scale, zero_point, output_type)
    return FileQParams(scale, zero_point, onnx_type, lo, hi, axis, where, block_size)


def _zero_point(where, scale, zero_point, output_type) -> tuple[np.ndarray, int, int, int]:
    """The zero point (int64, zeros when absent), its ONNX type and that type's range."""
    if zero_point is None:
        onnx_type = output_type if output_type is not None else TensorProto.UINT8
        zero_point = np.zeros(scale.shape, dtype=np.int64)
    else:
        zero_point = np.asarray(zero_point)
        onnx_type = onnx_type_of(zero_point)
        if zero_point.shape != scale.shape:
            raise ValueError(
                f"{where}: zero point shape {zero_point.shape} differs from scale shape "
                f"{scale.shape}; they must match"
            )
    if onnx_type not in INTEGER_TYPES:
        name = TensorProto.DataType.Name(onnx_type) if onnx_type is not None else zero_point.dtype
        raise ValueError(
            f"{where}: integer type {name} is not supported; quantbridge imports int8, uint8, "
            "int16, uint16, int4 and uint4 codes"
        )
    zero_point = zero_point.astype(np.int64)
    lo, hi = type_range(onnx_type)
    outside = (zero_point < lo) | (zero_point > hi)
    if outside.any():
        raise ValueError(
            f"{where}: zero point {zero_point[outside][:4].tolist()} is outside the range "
            f"[{lo}, {hi}] of {TensorProto.DataType.Name(onnx_type)}; use a zero point inside it"
        )
    return zero_point, onnx_type, lo, hi
