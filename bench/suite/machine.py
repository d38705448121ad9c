"""What the numbers were measured on: CPU model and ISA flags, cores, memory, load, versions."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import subprocess
import threading
from pathlib import Path

# ISA features that decide which INT8 / BF16 kernels the engines pick on x86.
FLAGS_OF_INTEREST = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
    "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
)  # fmt: skip
PACKAGES = (
    "quantbridge", "torch", "onnx", "onnxruntime", "openvino", "numpy", "onnxscript",
    "transformers", "scikit-learn", "pillow",
)  # fmt: skip


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "flags") and key not in info:
                info[key] = value.strip()
    except OSError:
        pass
    return info


def _mem_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(root: Path) -> dict[str, object]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "src")
        branch = git("rev-parse", "--abbrev-ref", "HEAD")
        return {"commit": commit or None, "branch": branch or None, "library_modified": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "library_modified": None}


def describe(root: Path) -> dict[str, object]:
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "isa": {f: (f in flags) for f in FLAGS_OF_INTEREST},
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": _mem_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in PACKAGES},
        "git": _git(root),
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def boost_priority(nice: int = -10) -> str:
    """Own session + niced autogroup so other jobs on a shared box disturb timing less (as in
    ``bench/forms_study``). With CONFIG_SCHED_AUTOGROUP a plain ``nice`` only ranks threads inside
    one session, hence the autogroup write. Needs root or CAP_SYS_NICE; returns what it applied."""
    try:
        os.setsid()
    except OSError:
        pass
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
        return f"autogroup nice {nice}"
    except OSError:
        try:
            os.nice(nice)
            return f"nice {nice}"
        except OSError as e:
            return f"none ({e.strerror})"


class LoadSampler:
    """The 1-minute load average every ``period`` seconds while the suite runs, so the report can
    say how loaded a shared machine was (start and end alone miss a busy middle). A daemon thread
    that wakes twice a minute: nothing a timing notices."""

    def __init__(self, period: float = 30.0) -> None:
        self.period, self.samples = period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def _sample(self) -> None:
        if hasattr(os, "getloadavg"):
            self.samples.append(os.getloadavg()[0])

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> LoadSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def summary(self) -> dict | None:
        """``{"period_s", "n", "min", "median", "max"}`` of the samples (None without any)."""
        if not self.samples:
            return None
        return {"period_s": self.period, "n": len(self.samples), "min": min(self.samples),
                "median": statistics.median(self.samples), "max": max(self.samples)}  # fmt: skip
