"""The kernel registry of the numpy executor: op type -> pure function on integer arrays."""

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
