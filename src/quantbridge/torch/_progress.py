"""Progress of the long steps - capture, calibration, export - on stderr.

Each stage is one line, ``quantbridge: capturing DetNet (torch.export) ... 12.3 s``: its name
when it starts (so a 20-second capture does not look hung) and its time when it ends.
Calibration shows a tqdm bar when stderr is a terminal, and the same one line otherwise.

On by default; ``set_progress(False)`` (``qb.set_progress``) turns it off for the process,
``quantize(..., progress=False)`` for one call, ``quantbridge demo --quiet`` on the command line.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator

from tqdm.auto import tqdm

_STATE = {"enabled": True}


def set_progress(enabled: bool) -> None:
    """Progress lines on stderr for capture, calibration and export: on (default) or off."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_progress(enabled) takes True or False, got {enabled!r}")
    _STATE["enabled"] = enabled


@contextlib.contextmanager
def progress_scope(enabled: bool) -> Iterator[None]:
    """The process-wide switch set to ``enabled`` inside the block (a call's ``progress=False``
    silences every stage it runs, export included), restored after."""
    was = _STATE["enabled"]
    _STATE["enabled"] = bool(enabled) and was
    try:
        yield
    finally:
        _STATE["enabled"] = was


def progress_enabled(override: bool | None = None) -> bool:
    """``override`` if given (a call's ``progress=``), else the process-wide switch."""
    return _STATE["enabled"] if override is None else bool(override)


@contextlib.contextmanager
def stage(what: str, enabled: bool | None = None) -> Iterator[None]:
    """``quantbridge: <what> ... <seconds> s`` on one stderr line around the block."""
    if not progress_enabled(enabled):
        yield
        return
    print(f"quantbridge: {what} ...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        print(" failed", file=sys.stderr, flush=True)
        raise
    print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def progress_bar(iterable: Iterable, enabled: bool | None, desc: str, total: int | None = None):
    """``iterable`` with a tqdm bar on a terminal, with one ``stage`` line otherwise."""
    if not progress_enabled(enabled):
        yield from iterable
        return
    if sys.stderr.isatty():
        yield from tqdm(iterable, desc=desc, total=total, unit="batch", leave=False)
        return
    count = f" on {total} batches" if total is not None else ""
    with stage(f"{desc}{count}"):
        yield from iterable
