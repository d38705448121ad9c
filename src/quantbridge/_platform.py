"""Facts about the CPU this process runs on that change what an INT8 engine computes.

x86 CPUs without VNNI (AVX2, and AVX-512 without ``avx512_vnni``) have no instruction that sums
uint8 x int8 products into int32 directly. ONNX Runtime (MLAS) and OpenVINO (oneDNN) then use
``vpmaddubsw``, which adds two adjacent products into an int16 with saturation:
``sat16(a0 * w0 + a1 * w1)``, with a in [0, 255] and w in [-128, 127]. Two products reach
2 * 255 * 127 = 64770 > 32767, so full-range int8 weights meeting large uint8 activation codes are
clipped inside the engine's accumulation - ONNX Runtime's quantization guide names the same effect
and suggests 7-bit weights ("reduce_range") or U8U8. Measured on an AVX2 EPYC with ORT 1.32:
ResNet-18-style QDQ export, 72% of outputs within 1 LSB of the exact integer result with
[-127, 127] weights, 100% with [-63, 63] weights (2 * 255 * 63 = 32130 fits in int16).

CPUs with VNNI (``avx512_vnni``, ``avx_vnni``) or AMX sum into int32 (``vpdpbusd``), and Arm's
dot-product instructions widen as well: no saturation there.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

_X86 = ("x86_64", "amd64", "i386", "i686")

_INT32_DOT = ("avx512_vnni", "avx_vnni", "amx_int8")


class SaturationWarning(UserWarning):
    """The exported or folded form is correct, but this machine's int8 engines will not compute
    it exactly (uint8 x int8 pair sums saturating in int16, above)."""


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo`` (Linux); None where they cannot be read."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in info.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return None


def u8s8_saturates() -> bool:
    """True when this machine's x86 int8 kernels add uint8 x int8 products pairwise in int16
    with saturation (no VNNI / AMX); False on VNNI x86, on other architectures, and where the
    flags cannot be read (nothing is claimed then)."""
    if platform.machine().lower() not in _X86:
        return False
    flags = cpu_flags()
    if flags is None:
        return False
    return not any(f in flags for f in _INT32_DOT)


def safe_weight_bound() -> int:
    """Largest |int8 weight code| for which ``vpmaddubsw`` cannot saturate with uint8 inputs:
    2 * 255 * w <= 32767 -> w <= 64; a symmetric narrow grid uses +-63 (7 bits)."""
    return 63
