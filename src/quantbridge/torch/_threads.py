"""``one_thread()``: run a block with torch's intra-op pool at one thread, restored after.

Why: bias correction (``ptq._bias_correction``) is thousands of small float64 ops (per-tap slice
means, per-channel sums). At torch's default thread count each op wakes the OpenMP pool, whose
threads then spin waiting for work: on a two-core machine it cost 6.8 CPU s and 17.6 s wall on a
ResNet-18-style model against 2.2 / 4.6 at one thread, same exported file (SHA-256 equal). One
thread also makes those float64 sums independent of the machine's core count (a reduction split
across threads adds in another order).
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
