"""Error metrics of one tensor between two engines, in float and in LSBs of the tensor's step.

Both arrays are real values (integer codes already dequantized, ``r = scale * (q - zero_point)``),
compared in float64. With ``a`` the reference and ``e = b - a``:

* ``sqnr_db = 10 log10(sum a^2 / sum e^2)``; None where it is not finite (``e`` all zero: the
  tensors are equal; or ``a`` all zero), so the JSON stays standard;
* ``cosine = <a, b> / (|a| |b|)`` clipped to [-1, 1] (1.0 when both are all zero, 0.0 when only
  one is);
* ``max_abs = max |e|``, ``mean_abs = mean |e|``;
* with the tensor's ``scale`` (its quantization step): ``lsb = rint(e / scale)`` per element (an
  integer for two quantized engines, whose values lie on the same grid; the nearest step for a
  float engine), ``lsb_share`` the shares of elements with ``|lsb|`` = 0, 1, 2 and > 2 (sum 1),
  ``lsb_hist`` the signed histogram of ``lsb`` clipped at +-8, and ``max_lsb = max |e| / scale``
  (not rounded). All three are None when the tensor has no scale (a float tensor).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

HIST_CLIP = 8  # signed LSB errors beyond +-HIST_CLIP are counted in the end bins


def tensor_metrics(a: np.ndarray, b: np.ndarray, scale: float | None) -> dict[str, Any]:
    """The metrics of ``b`` against the reference ``a`` (same shape); see the module docstring.
    ValueError when the shapes differ (the two engines computed different tensors)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} against {b.shape}")
    e = b - a
    signal, noise = float(np.sum(a * a)), float(np.sum(e * e))
    sqnr = None
    if 0.0 < noise < math.inf and 0.0 < signal < math.inf:  # an engine's inf: no SQNR
        sqnr = 10.0 * math.log10(signal / noise)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 and nb == 0.0:
        cosine = 1.0
    elif na == 0.0 or nb == 0.0:
        cosine = 0.0
    else:
        cosine = float(np.clip(np.dot(a.ravel(), b.ravel()) / (na * nb), -1.0, 1.0))
    abs_e = np.abs(e)
    out: dict[str, Any] = {
        "sqnr_db": sqnr,
        "cosine": cosine,
        "max_abs": float(abs_e.max()) if e.size else 0.0,
        "mean_abs": float(abs_e.mean()) if e.size else 0.0,
        "lsb_share": None,
        "lsb_hist": None,
        "max_lsb": None,
    }
    if scale is not None and scale > 0 and e.size:
        out.update(lsb_metrics(e, scale))
    return out


def lsb_metrics(error: np.ndarray, scale: float) -> dict[str, Any]:
    """``lsb_share``, ``lsb_hist`` and ``max_lsb`` of the real error ``error`` in steps of
    ``scale`` (see the module docstring)."""
    steps = error / scale
    lsb = np.rint(steps).astype(np.int64)
    mag = np.abs(lsb)
    n = lsb.size
    share = {
        "0": float(np.count_nonzero(mag == 0)) / n,
        "1": float(np.count_nonzero(mag == 1)) / n,
        "2": float(np.count_nonzero(mag == 2)) / n,
        ">2": float(np.count_nonzero(mag > 2)) / n,
    }
    clipped = np.clip(lsb, -HIST_CLIP, HIST_CLIP)
    counts = np.bincount(clipped.ravel() + HIST_CLIP, minlength=2 * HIST_CLIP + 1)
    hist = [[int(v), int(c)] for v, c in zip(range(-HIST_CLIP, HIST_CLIP + 1), counts, strict=True)]
    return {"lsb_share": share, "lsb_hist": hist, "max_lsb": float(np.abs(steps).max())}
