"""Emitters of an ``IntegerProgram``, bit-exact with the numpy executor: portable C99 (``_c``)
and integer-only ONNX (``_onnx``)."""

from . import (  # noqa: F401  (register their steps)
    _c_conv,
    _c_divide,
    _c_index,
    _c_normalize,
    _onnx_divide,
    _onnx_index,
    _onnx_normalize,
    _resize,
)
from ._c import emit_c
from ._onnx import to_onnx

__all__ = ["emit_c", "to_onnx"]
