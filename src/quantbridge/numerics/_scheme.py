"""Quantization schemes: granularity and the integer grid, as small frozen, self-validating types.

A scheme fixes the integer grid ``[qmin, qmax]`` and how scale and zero point are chosen
(see ``choose_qparams``); it holds no scale or zero point itself.

Integer grid for ``bits = b``::

    signed,   full range:    qmin = -2**(b-1),      qmax = 2**(b-1) - 1
    signed,   narrow range:  qmin = -2**(b-1) + 1,  qmax = 2**(b-1) - 1     (symmetric around 0)
    unsigned, full range:    qmin = 0,              qmax = 2**b - 1
    unsigned, narrow range:  qmin = 0,              qmax = 2**b - 2
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._xp import normalize_axis

MIN_BITS = 2
MAX_BITS = 16
SCALE_CONSTRAINTS = ("float", "pow2")


@dataclass(frozen=True)
class PerTensor:
    """One scale and zero point for the whole tensor."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "per_tensor"}


@dataclass(frozen=True)
class PerChannel:
    """One scale and zero point per index along ``axis`` (ONNX's per-axis quantization).

    ``axis`` may be negative; it is normalised against the tensor's rank when used.
    """

    axis: int

    def __post_init__(self) -> None:
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise TypeError(f"PerChannel.axis must be an int, got {self.axis!r}")

    def resolve_axis(self, ndim: int) -> int:
        """The axis in ``[0, ndim)``; ValueError if the tensor has no such axis."""
        return normalize_axis(self.axis, ndim)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "per_channel", "axis": self.axis}


@dataclass(frozen=True)
class PerBlock:
    """One scale and zero point per block of ``block_size`` consecutive elements along ``axis``
    (ONNX opset 21 blocked quantization, group-wise weights). The parameters have the tensor's
    rank with ``ceil(n / block_size)`` entries along ``axis`` (the last block may be partial);
    ``_xp.expand_blocks`` maps them to elements.

    Imported from files (``DequantizeLinear(block_size=...)``, ``MatMulNBits``); calibration
    (observers) and recipes do not choose blocked parameters.
    """

    axis: int
    block_size: int

    def __post_init__(self) -> None:
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise TypeError(f"PerBlock.axis must be an int, got {self.axis!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(f"PerBlock.block_size must be an int, got {self.block_size!r}")
        if self.block_size < 1:
            raise ValueError(f"PerBlock.block_size must be >= 1, got {self.block_size}")

    def resolve_axis(self, ndim: int) -> int:
        return normalize_axis(self.axis, ndim)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "per_block", "axis": self.axis, "block_size": self.block_size}


Granularity = PerTensor | PerChannel | PerBlock


def granularity_from_dict(d: dict[str, Any]) -> Granularity:
    """Inverse of ``PerTensor.to_dict`` / ``PerChannel.to_dict``."""
    if not isinstance(d, dict):
        raise TypeError(f"granularity must be a dict such as {{'kind': 'per_tensor'}}, got {d!r}")
    kind = d.get("kind")
    allowed = {
        "per_tensor": {"kind"},
        "per_channel": {"kind", "axis"},
        "per_block": {"kind", "axis", "block_size"},
    }
    if kind not in allowed:
        raise ValueError(
            f"granularity kind {kind!r} is unknown; use 'per_tensor', 'per_channel' or 'per_block'"
        )
    for key in d:
        if key not in allowed[kind]:
            raise ValueError(f"unknown key {key!r} in {kind} granularity; allowed: {allowed[kind]}")
    if kind == "per_tensor":
        return PerTensor()
    if "axis" not in d:
        raise ValueError(f"{kind} granularity needs an 'axis'")
    if kind == "per_block":
        if "block_size" not in d:
            raise ValueError("per_block granularity needs a 'block_size'")
        return PerBlock(axis=d["axis"], block_size=d["block_size"])
    return PerChannel(axis=d["axis"])


@dataclass(frozen=True)
class QScheme:
    """How one tensor is quantized: bit width, signedness, symmetry, range, granularity, scale.

    * ``bits``: 2..16 inclusive.
    * ``symmetric``: signed -> ``zero_point = 0``; unsigned -> ``zero_point`` is the grid midpoint
      ``(qmin + qmax + 1) // 2`` (128 for uint8).
    * ``narrow_range``: drop the most negative code (signed) or the top code (unsigned).
    * ``scale_constraint``: ``"float"`` (any positive float32) or ``"pow2"`` (``2**k``).
    """

    bits: int = 8
    signed: bool = True
    symmetric: bool = True
    narrow_range: bool = False
    granularity: PerTensor | PerChannel | PerBlock = field(default_factory=PerTensor)
    scale_constraint: str = "float"

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise TypeError(f"QScheme.bits must be an int, got {self.bits!r}")
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise ValueError(
                f"QScheme.bits={self.bits} is not supported; allowed range is "
                f"{MIN_BITS}..{MAX_BITS} inclusive"
            )
        for name in ("signed", "symmetric", "narrow_range"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"QScheme.{name} must be a bool, got {value!r}")
        if not isinstance(self.granularity, (PerTensor, PerChannel, PerBlock)):
            raise TypeError(
                f"QScheme.granularity must be PerTensor(), PerChannel(axis=...) or "
                f"PerBlock(axis=..., block_size=...), "
                f"got {self.granularity!r}"
            )
        if self.scale_constraint not in SCALE_CONSTRAINTS:
            raise ValueError(
                f"QScheme.scale_constraint={self.scale_constraint!r} is unknown; "
                f"use one of {SCALE_CONSTRAINTS}"
            )

    @property
    def qmin(self) -> int:
        if not self.signed:
            return 0
        return -(2 ** (self.bits - 1)) + (1 if self.narrow_range else 0)

    @property
    def qmax(self) -> int:
        if not self.signed:
            return 2**self.bits - (2 if self.narrow_range else 1)
        return 2 ** (self.bits - 1) - 1

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; ``QScheme.from_dict(s.to_dict()) == s``."""
        return {
            "bits": self.bits,
            "signed": self.signed,
            "symmetric": self.symmetric,
            "narrow_range": self.narrow_range,
            "granularity": self.granularity.to_dict(),
            "scale_constraint": self.scale_constraint,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QScheme:
        """Build from ``to_dict`` output; missing keys take defaults, unknown keys -> ValueError."""
        if not isinstance(d, dict):
            raise TypeError(f"QScheme.from_dict expects a dict, got {type(d).__name__}")
        allowed = ("bits", "signed", "symmetric", "narrow_range", "granularity", "scale_constraint")
        for key in d:
            if key not in allowed:
                raise ValueError(f"unknown key {key!r} in QScheme dict; allowed keys: {allowed}")
        kwargs = dict(d)
        if "granularity" in kwargs:
            kwargs["granularity"] = granularity_from_dict(kwargs["granularity"])
        return cls(**kwargs)


def storage_dtype(scheme: QScheme) -> np.dtype:
    """Smallest numpy integer container for the scheme's codes that ONNX can also hold.

    ``bits <= 8`` -> int8 / uint8, ``bits <= 16`` -> int16 / uint16. Codes of 2..7 bits live in
    an 8-bit container (numpy has no int4; choosing ONNX's INT4/UINT4 type for 4-bit codes is a
    graph-level decision of the ONNX layer).
    """
    if scheme.bits <= 8:
        return np.dtype(np.int8 if scheme.signed else np.uint8)
    return np.dtype(np.int16 if scheme.signed else np.uint16)
