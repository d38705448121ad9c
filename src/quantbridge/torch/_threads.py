"""``one_thread()``: run a block with torch's intra-op pool at one thread, restored after.

Why: bias correction (``ptq._bias_correction``) computes, per layer and batch, a few hundred
small float64 ops (per-tap slice means, per-channel sums). At torch's default thread count each
one wakes the OpenMP pool, whose threads then spin waiting for work. Only those statistics run
inside the block: the float pass's own layers keep the caller's threads, because a convolution's
float32 result can depend on the thread count (pinning the whole pass changed 16 int32 bias
codes by 1 in the PP-OCRv4 detector's file) while these reductions gave bit-identical files
(exported SHA-256 equal on ResNet-18-style and the detector, 2 threads, fresh processes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["one_thread"]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """``torch.set_num_threads(1)`` inside the block; the caller's count back after it, also
    when the block raises."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
