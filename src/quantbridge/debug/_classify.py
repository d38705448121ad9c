"""The class of one tensor's disagreement between two engines (thresholds documented in
``docs/debugging.md``).

* ``"exact"``: the two tensors are identical.
* ``"quantization noise"``: one of the two engines computes in float (torch float, ORT on the
  float model): its difference to a quantized engine is the quantization itself.
* ``"rounding"``: two quantized engines within ``ROUNDING_LSB`` (1) step of the tensor's scale
  everywhere: a tie rounded the other way (half-to-even against half-away-from-zero, a float
  against a fixed-point requantization multiplier), then carried through.
* ``"rounding"`` too: two quantized engines further apart than 1 step, by no more than the
  error their inputs already carried (``carried``: the sum of the ``max_abs`` of the same engine
  pair on the tensors it is computed from, as an Add's two input errors add up; only where
  every op between them is in ``optables.UNIT_GAIN_OPS``, which cannot grow an error; for a
  product of two tensors (element by element or a MatMul), a tensor times a constant, a
  Linear (``|dx @ W|``), a convolution (``|conv(dx, W)|``, both element by element, signed ``dx``) or an elementwise chain of one tensor (GELU, SiLU ...: its slope,
  ``_gain``), the exact bound of
  what its inputs carried, ``compare._carried``) plus 1 step: an earlier 1-step difference seen in a finer step
  (a 1-step error on a tensor of step 0.108 is 5 steps of the next tensor's 0.0235).
* ``"divergence"``: two quantized engines more than 1 step apart somewhere, beyond what their
  inputs carried: a fusion, an engine bug, a broken scale, or a real difference between files.

Tensors without a scale (float outputs of two quantized engines) have no step: they count as
``"rounding"`` while ``max_abs <= FLOAT_RTOL * max |reference| + FLOAT_ATOL`` (or within what
their inputs carried) and ``"divergence"`` beyond. ``FLOAT_ATOL`` is float32 noise on values of
order 1 (a Sigmoid output near 0 has a tiny peak; 2e-10 apart is not a divergence).
"""

from __future__ import annotations

from typing import Any

ROUNDING_LSB = 1.0
# tolerance on the step count: dequantized values carry float32 rounding (~1e-7 relative)
LSB_EPS = 1e-3
FLOAT_RTOL = 1e-2
FLOAT_ATOL = 1e-6

CLASSES = ("exact", "quantization noise", "rounding", "divergence")


def classify(
    metrics: dict[str, Any],
    *,
    a_float: bool,
    b_float: bool,
    reference_peak: float,
    carried: float = 0.0,
    scale: float | None = None,
) -> str:
    """The class of ``metrics`` (``tensor_metrics`` of engine b against engine a);
    ``reference_peak`` is ``max |a|`` (used for tensors without a scale), ``carried`` the sum
    of the same pair's largest absolute errors on the tensor's input tensors, ``scale`` its
    step."""
    if metrics["max_abs"] == 0.0:
        return "exact"
    if a_float or b_float:
        return "quantization noise"
    if metrics["max_lsb"] is not None:
        if metrics["max_lsb"] <= ROUNDING_LSB + LSB_EPS:
            return "rounding"
        if scale and metrics["max_abs"] <= carried + scale * (ROUNDING_LSB + LSB_EPS):
            return "rounding"
        return "divergence"
    bound = max(FLOAT_RTOL * reference_peak + FLOAT_ATOL, carried * (1 + LSB_EPS))
    return "rounding" if metrics["max_abs"] <= bound else "divergence"
