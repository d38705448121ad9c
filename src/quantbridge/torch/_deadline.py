"""A time limit on symbolic capture, so that ``dynamic="all"`` never hangs.

``torch.export`` with every dimension dynamic reasons about sizes with sympy; on some models that
reasoning explodes (MobileViT-XXS: stuck for more than 15 minutes with ``dynamic="all"``, 5 s
with ``dynamic="batch"``). ``deadline(seconds)`` interrupts the block with ``CaptureTimeout`` when
the time is up (``SIGALRM``, so only on the main thread of a POSIX process; elsewhere the block
runs unbounded). ``CaptureTimeout`` derives from ``BaseException`` so that no ``except Exception``
inside torch or sympy swallows it and carries on.

The interruption is raised only while sympy (or torch's pure sympy helpers) is running: an
exception raised at an arbitrary bytecode can land inside a ``finally`` or ``__exit__`` that
restores torch's global state (dispatch modes, the eval-frame hook), leave that state broken and
crash a later capture (seen as a segfault in CI, a few tests after a 1 ms budget fired). When the
timer fires elsewhere, it is re-armed for ``RETRY_S`` and tried again, so the block ends at the
first sympy step after the budget. The explosion this guards against is sympy's.

The limit is ``CAPTURE_BUDGET_S`` seconds, or the ``QB_CAPTURE_BUDGET_S`` environment variable
(``0`` or ``none`` turns it off).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

CAPTURE_BUDGET_S = 120.0
RETRY_S = 0.002
# modules whose frames hold no torch global state: safe places to raise an interruption
_SAFE_MODULES = ("sympy", "torch.utils._sympy")


class CaptureTimeout(BaseException):  # noqa: N818 - an interruption, like KeyboardInterrupt
    """Symbolic capture ran past its time limit."""


def capture_budget() -> float | None:
    """Seconds a ``dynamic="all"`` capture may take (``QB_CAPTURE_BUDGET_S`` overrides)."""
    text = os.environ.get("QB_CAPTURE_BUDGET_S", "").strip().lower()
    if not text:
        return CAPTURE_BUDGET_S
    if text in ("0", "none", "off"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"QB_CAPTURE_BUDGET_S={text!r}: expected a number of seconds (or 'none')"
        ) from None
    return value if value > 0 else None


def can_interrupt() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Raise ``CaptureTimeout`` inside the block after ``seconds`` (None: no limit)."""
    if seconds is None or not can_interrupt():
        yield
        return

    def expired(signum, frame):
        if _is_safe(frame):
            raise CaptureTimeout(f"capture took longer than {seconds:g} s")
        signal.setitimer(signal.ITIMER_REAL, RETRY_S)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _is_safe(frame) -> bool:
    """The interrupted frame is sympy's own code (not a cleanup handler of torch's)."""
    if frame is None:
        return False
    name = frame.f_globals.get("__name__", "")
    return any(name == m or name.startswith(m + ".") for m in _SAFE_MODULES)
