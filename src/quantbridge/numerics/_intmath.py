"""Integer division and square root for integer-only normalizations (softmax, layer norm, L2
normalization, division of two tensors).

Both are defined on int64 numpy arrays, and the C and integer-ONNX emitters of
``quantbridge.integer`` write the same operations out, so all three agree bit for bit:

* ``round_divide(a, b)``: ``floor((2a + b) / (2b))`` for ``b > 0``, i.e. ``a / b`` rounded to
  nearest with ties toward +infinity (``2.5 -> 3``, ``-2.5 -> -2``). One flooring division of
  integers: no float, the same in numpy (``//``), C (a flooring helper) and ONNX (truncating
  Div corrected by one where the remainder is negative).
* ``divide_half_even(a, b)``: ``a / b`` rounded to nearest, ties to even, for ``b > 0`` (the rule
  of ``requantize`` and of ONNX QuantizeLinear, so a quotient that lands exactly on a tie gets
  the code the float model's QuantizeLinear gives it): ``q = floor(a / b)``, ``r = a - q b`` in
  ``[0, b)``, then ``q + 1`` when ``2r > b`` or when ``2r == b`` and ``q`` is odd. Exact for
  ``|a| < 2**63`` and ``0 < b < 2**62`` (``2r < 2b`` fits int64).
* ``isqrt_newton(w)``: ``floor(sqrt(w))`` for ``1 <= w < 2**62`` by Newton's iteration from
  above, a fixed number of steps (``ISQRT_STEPS``) so that it unrolls in ONNX and vectorizes:

      x0 = 2**c with c = #{j in 0..31 : w >= 4**j}        (w < 4**c, so x0 > sqrt(w) >= x0 / 2)
      x_{k+1} = min(x_k, floor((x_k + floor(w / x_k)) / 2))

  From above, Newton's integer step decreases until it reaches ``floor(sqrt(w))`` and then
  stays (``x + w // x >= 2x`` there), and the ``min`` keeps it; the relative error from
  ``x0 <= 2 sqrt(w)`` squares each step (1 -> 1/4 -> 2.5e-2 -> 3e-4 -> 5e-8 -> 1e-15 -> 1e-30),
  so 7 steps reach the floor for every ``w < 2**62`` (tested against ``math.isqrt``).
"""

from __future__ import annotations

import numpy as np

ISQRT_STEPS = 7
ISQRT_MAX = 2**62  # exclusive bound on w: every intermediate fits int64


def round_divide(a: object, b: object) -> np.ndarray:
    """``a / b`` rounded to nearest, ties toward +inf: ``floor((2a + b) / (2b))``, int64, b > 0;
    the caller keeps ``|2a + b| < 2**63``."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    return (2 * a + b) // (2 * b)


def divide_half_even(a: object, b: object) -> np.ndarray:
    """``a / b`` rounded to nearest, ties to even, int64, ``0 < b < 2**62`` (module docstring):
    ``7 / 2 -> 4``, ``5 / 2 -> 2``, ``-5 / 2 -> -2``, ``-7 / 2 -> -4``."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    q = a // b
    r2 = 2 * (a - q * b)
    return q + ((r2 > b) | ((r2 == b) & (q & 1 == 1)))


def isqrt_newton(w: object) -> np.ndarray:
    """``floor(sqrt(w))`` on int64 ``1 <= w < 2**62`` by ``ISQRT_STEPS`` Newton steps (module
    docstring)."""
    w = np.asarray(w, np.int64)
    powers = np.int64(4) ** np.arange(32, dtype=np.int64)
    c = (w[..., None] >= powers).sum(axis=-1).astype(np.int64)
    x = np.left_shift(np.int64(1), c)
    for _ in range(ISQRT_STEPS):
        x = np.minimum(x, (x + w // x) // 2)
    return x
