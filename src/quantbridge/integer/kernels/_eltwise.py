"""Elementwise kernels: rescaled sums (Add, Concat, requantization), Mul, 256-entry tables.

``rescale_sum`` (Add with any input scales; one input: a plain requantization):
    r_y = sum_i s_i (q_i - z_i)   ->   q_y = clip(z_y + round_half_even(sum_i M_i (q_i - z_i) / 2**n))
    with M_i / 2**n ~= s_i / s_y over one shared shift n (numerics.common_shift_multipliers).
    Bound: |sum| <= sum_i M_i * max|q_i - z_i| < k * 2**31 * 2**16, far inside int64.
``mul``: r_y = s_a s_b (q_a - z_a)(q_b - z_b); acc = (q_a - z_a)(q_b - z_b), |acc| <= 2**16 for
    8-bit operands (2**34 for 16-bit: the lowering then gives M fewer bits, |acc| M < 2**62);
    q_y = clip(z_y + round_half_even(acc M / 2**n)) with M / 2**n ~= s_a s_b / s_y.
``concat``: each input requantized to the output's (scale, zero point), then concatenated.
``lut``: q_y = table[q_x - qmin(x)], the table holding quantize(f(dequantize(q))) for all codes.
"""

from __future__ import annotations

import numpy as np

from ...numerics import requantize
from ._registry import register_kernel


def _centered(q: np.ndarray, zero: int) -> np.ndarray:
    return q.astype(np.int64) - np.int64(zero)


@register_kernel("rescale_sum")
def rescale_sum(attrs, *inputs: np.ndarray) -> np.ndarray:
    acc = np.int64(0)
    for q, z, m in zip(inputs, attrs["zeros"], attrs["multipliers"], strict=True):
        acc = acc + _centered(q, z) * np.int64(m)
    y = requantize(acc, 1, attrs["shift"], attrs["out_zero"], attrs["qmin"], attrs["qmax"])
    return y.astype(attrs["dtype"])


@register_kernel("mul")
def mul(attrs, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    acc = _centered(a, attrs["zeros"][0]) * _centered(b, attrs["zeros"][1])
    y = requantize(
        acc, attrs["multiplier"], attrs["shift"], attrs["out_zero"], attrs["qmin"], attrs["qmax"]
    )
    return y.astype(attrs["dtype"])


@register_kernel("concat")
def concat(attrs, *inputs: np.ndarray) -> np.ndarray:
    parts = [
        requantize(_centered(q, z), m, n, attrs["out_zero"], attrs["qmin"], attrs["qmax"])
        for q, z, m, n in zip(
            inputs, attrs["zeros"], attrs["multipliers"], attrs["shifts"], strict=True
        )
    ]
    return np.concatenate(parts, axis=attrs["axis"]).astype(attrs["dtype"])


@register_kernel("lut")
def lut(attrs, x: np.ndarray) -> np.ndarray:
    return attrs["table"][x.astype(np.int64) - attrs["in_qmin"]]
