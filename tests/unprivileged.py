"""Permission tests as root: root ignores permission bits, so the call under test runs again in
a forked child that has dropped to the unprivileged user ``nobody`` (uid/gid 65534) - the
library's own check against real permissions, no mock.

``call_as_nobody(fn)`` returns what ``fn()`` raised, as ``"TypeName: message"`` (or
``"returned"``). Fork, not a new interpreter: the interpreter lives under ``/root`` (mode 0700),
which ``nobody`` cannot enter. Folders the child uses must be reachable by ``nobody``:
``reachable_folder()`` (0o755, under the system temp dir; pytest's ``tmp_path`` is 0o700).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

NOBODY = 65534


def is_root() -> bool:
    return os.geteuid() == 0


def reachable_folder() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="qb-nobody-"))
    folder.chmod(0o755)
    return folder


def call_as_nobody(fn: Callable[[], object], timeout: float = 120) -> str:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges, call, report, exit without cleanup handlers
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                fn()
                message = "returned"
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                message = f"{type(e).__name__}: {e}"
            os.write(write_end, message.encode()[:60000])
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"the unprivileged child did not finish in {timeout} s")
        time.sleep(0.02)
    with os.fdopen(read_end, "rb") as f:
        return f.read().decode()
