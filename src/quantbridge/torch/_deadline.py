"""A time limit on symbolic capture, so that ``dynamic="all"`` never hangs.

``torch.export`` with every dimension dynamic reasons about sizes with sympy; on some models that
reasoning explodes (MobileViT-XXS: stuck for more than 15 minutes with ``dynamic="all"``, 5 s
with ``dynamic="batch"``). ``deadline(seconds)`` interrupts the block with ``CaptureTimeout``
after ``seconds``. ``CaptureTimeout`` derives from ``BaseException`` so that no
``except Exception`` inside torch or sympy swallows it and carries on.

How, and why this way: a timer *thread* calls ``_thread.interrupt_main(SIGALRM)`` at the budget:
that simulates a signal for the main thread's Python handler only, so no operating-system signal
reaches any thread (a process-wide ``SIGALRM`` also lands in native thread pools, ONNX Runtime's,
OpenVINO's, OpenMP's, and interrupts their system calls). The handler raises nothing and never
touches its frame (in CPython 3.11 the frame handed to a signal handler can be one still being set
up; reading its ``f_globals`` segfaulted here); it installs a profile function, and that function
raises ``CaptureTimeout`` at the next *call of a sympy function* (or of torch's pure sympy helpers)
with no import running below it. Raising at an arbitrary bytecode, an earlier design, can land in a
``finally`` or ``__exit__`` that restores torch's global state (dispatch modes, the eval-frame
hook) and crash a later capture; a function call into sympy is an ordinary place for an exception
in torch's Python code, and the explosion this guards against is sympy's. Never in a resumed
generator's frame: a generator resumed by the garbage collector's ``close()`` reports the
exception as "ignored" and carries on (seen in CI: sympy's ``deduce_all_facts`` generator swallowed
it, and the block then ran unbounded for 34 minutes). For any other place that swallows it (a bare
``except:``, a ``__del__``), the timer fires again every ``_REARM_S`` seconds while the block still
runs, and the next sympy call raises again. Where a profiler is
already installed (``cProfile``), the block is not interrupted. Only the main thread can be
interrupted; elsewhere the block runs unbounded.

The limit is ``CAPTURE_BUDGET_S`` seconds, or the ``QB_CAPTURE_BUDGET_S`` environment variable
(``0`` or ``none`` turns it off).
"""

from __future__ import annotations

import _thread
import contextlib
import inspect
import os
import signal
import sys
import threading
from collections.abc import Iterator

CAPTURE_BUDGET_S = 120.0
_REARM_S = 1.0  # after an interruption that did not end the block, the next one comes this late
# source folders whose functions hold no torch global state: safe places to raise an interruption
_SAFE_FOLDERS = (os.sep + "sympy" + os.sep, os.path.join("torch", "utils", "_sympy") + os.sep)


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
    """Only the main thread's Python handlers can be run by ``interrupt_main``."""
    return hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Raise ``CaptureTimeout`` inside the block at the first sympy call after ``seconds``
    (None: no limit)."""
    if seconds is None or not can_interrupt():
        yield
        return
    message = f"capture took longer than {seconds:g} s"

    def at_sympy_call(frame, event, arg):
        if event == "call" and _is_safe(frame):
            sys.setprofile(None)
            raise CaptureTimeout(message)

    def expired(signum, frame):  # never touches ``frame``: in CPython 3.11 a signal handler's
        # frame can be one still being set up, and reading its f_globals segfaulted (seen here)
        if sys.getprofile() is None:  # never replace a profiler someone else installed
            sys.setprofile(at_sympy_call)

    stop = threading.Event()

    def ticks() -> None:  # the first at the budget, then again while the block still runs
        wait = seconds
        while not stop.wait(wait):
            _thread.interrupt_main(signal.SIGALRM)
            wait = _REARM_S

    previous = signal.signal(signal.SIGALRM, expired)
    timer = threading.Thread(target=ticks, name="quantbridge-capture-deadline", daemon=True)
    timer.start()
    try:
        yield
    finally:
        stop.set()
        timer.join()  # an interruption already simulated is now pending, not in flight
        # signal.signal runs pending handlers first (ours); a handler set from C reads as None
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
        if sys.getprofile() is at_sympy_call:
            sys.setprofile(None)


_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _is_safe(frame) -> bool:
    """The called function is sympy's own code (not a cleanup handler of torch's), and no module
    is being imported below it (torch imports submodules lazily during capture, and their
    module-level code calls sympy: an interruption there would leave a half-imported module)."""
    if frame is None:  # only f_code/f_back are read: never f_globals (see deadline's note)
        return False
    if not any(folder in frame.f_code.co_filename for folder in _SAFE_FOLDERS):
        return False
    if frame.f_code.co_flags & _GENERATOR_FLAGS:
        return False  # a resumed generator: a finalizer's close() would swallow the exception
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return False  # an import machinery frame: module-level code runs above it
        frame = frame.f_back
    return True
