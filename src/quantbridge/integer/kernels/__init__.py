"""Integer kernels of the numpy executor: one module per op family, a registry keyed by step op.

Each kernel is a pure function ``kernel(attrs, *inputs) -> codes`` on integer arrays; every one
that changes scale ends in ``numerics.requantize`` (one rounding, ties to even). The kernels' module
docstrings state ``r = s(q - z)``, the integer pipeline and the accumulator bound, TFLite style.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Kernel = Callable[..., np.ndarray]
KERNELS: dict[str, Kernel] = {}


def register_kernel(*ops: str) -> Callable[[Kernel], Kernel]:
    def add(fn: Kernel) -> Kernel:
        for op in ops:
            if op in KERNELS:
                raise ValueError(f"kernel {op!r} registered twice")
            KERNELS[op] = fn
        return fn

    return add


def run_step(step: Any, inputs: Sequence[np.ndarray]) -> np.ndarray:
    """Run one program step (``_program.Step``) on its input arrays."""
    kernel = KERNELS.get(step.op)
    if kernel is None:
        raise ValueError(f"step {step.node!r}: no kernel {step.op!r}; known: {sorted(KERNELS)}")
    return kernel(step.attrs, *inputs)


from . import _eltwise, _linear, _movement, _pool  # noqa: E402,F401  (fill the registry)

__all__ = ["KERNELS", "register_kernel", "run_step"]
