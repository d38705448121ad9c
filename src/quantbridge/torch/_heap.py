"""Handing the heap's free memory back to the system (glibc's ``malloc_trim``).

glibc serves allocations below its mmap threshold from the heap, and that threshold rises to
the size of the largest block freed (up to 32 MiB): once a 25 MB activation is freed, every
smaller tensor comes from the heap, and a small one that is still alive keeps the freed pages
around it resident. A pass that frees large values while it keeps small ones (the sequential
bias correction's walk: a batch's stem activations freed, its packed codes kept) then grows
its resident set by about one batch's activations per batch (ResNet-18-style, 64 images:
+50 MiB at the stem). ``malloc_trim(0)`` returns the free pages; a no-op where there is no
glibc."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl without it)
        return None


def release_free_memory() -> None:
    """Return the heap's free pages to the system (glibc); nothing elsewhere."""
    trim = _trim()
    if trim is not None:
        trim(0)
