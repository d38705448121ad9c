"""Integer kernels of the numpy executor: one module per op family, a registry keyed by step op.

Each kernel is a pure function ``kernel(attrs, *inputs) -> codes`` on integer arrays; every one
that changes scale ends in ``numerics.requantize`` (one rounding, ties to even). The kernels' module
docstrings state ``r = s(q - z)``, the integer pipeline and the accumulator bound, TFLite style.
"""

from __future__ import annotations

from . import _divide, _eltwise, _index, _linear, _movement, _normalize, _pool  # noqa: F401  (fill the registry)
from ._registry import KERNELS, Kernel, register_kernel, run_step

__all__ = ["KERNELS", "Kernel", "register_kernel", "run_step"]
