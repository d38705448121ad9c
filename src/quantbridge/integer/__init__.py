"""Integer-only programs: lowering of quantized ONNX (QDQ or integer operators) to a program in
which every tensor is integer codes and every rescale an integer multiplier and a shift.

* ``lowering/``  symbolic interpretation of the ONNX graph, a registry keyed by op type;
* ``kernels/``   the numpy executor (the reference), one module per op family;
* ``_program``   the program: tensors with their fixed-point formats, steps, ``run``;
* ``emit/``      integer-only ONNX and C99, bit-exact with the executor; ``_npz`` the arrays;
* ``_describe``  the fixed-point view (formats, multipliers and shifts) ``inspect`` prints.
"""

from ._describe import describe_fixed_point, requantizations
from ._npz import load_npz, save_npz
from ._program import Boundary, IntegerProgram, QTensor, Step
from .lowering import LoweringError, lower

__all__ = [
    "Boundary",
    "IntegerProgram",
    "LoweringError",
    "QTensor",
    "Step",
    "describe_fixed_point",
    "load_npz",
    "lower",
    "requantizations",
    "save_npz",
]
