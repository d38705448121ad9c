"""Bias quantization to int32 with ``scale = input_scale * weight_scale`` and zero point 0."""

from __future__ import annotations

import numpy as np

from ._fixed_point import INT32_MAX, INT32_MIN
from ._xp import _torch_of, broadcast_param


def _as_numpy(v: object, dtype: type) -> np.ndarray:
    if _torch_of(v) is not None:
        v = v.detach().cpu().numpy()
    return np.asarray(v, dtype=dtype)


def bias_scale(input_scale: object, weight_scale: object) -> np.ndarray:
    """``input_scale * weight_scale`` as one float32 multiplication (float32 result).

    This is the scale stored with the int32 bias (ONNX: the bias DequantizeLinear's scale;
    QLinearConv derives the same product). ``input_scale`` must hold one element,
    ``weight_scale`` one element or one per output channel.
    """
    input_scale = _as_numpy(input_scale, np.float32)
    weight_scale = _as_numpy(weight_scale, np.float32)
    if input_scale.size != 1:
        raise ValueError(f"input_scale must hold one element, got shape {input_scale.shape}")
    for name, s in (("input_scale", input_scale), ("weight_scale", weight_scale)):
        if not (np.isfinite(s) & (s > 0)).all():
            raise ValueError(f"{name} must be positive and finite, got {s}")
    scale = input_scale.reshape(()) * weight_scale
    if not (scale > 0).all():
        raise ValueError(f"input_scale * weight_scale underflows to 0 in float32: {scale}")
    return scale


def quantize_bias(
    bias: object, input_scale: object, weight_scale: object, axis: int = 0
) -> np.ndarray:
    """int32 bias codes: ``q = clip(round_half_even(bias / s), INT32_MIN, INT32_MAX)``.

    1. ``s = bias_scale(input_scale, weight_scale)`` -- float32 product (per channel when
       ``weight_scale`` is 1-D; it lies along ``axis`` of ``bias``, 0 for the usual 1-D bias);
    2. ``bias / s`` in float64 (both operands are exact in float64, one correctly rounded
       division). ONNX Runtime's quantizer divides in float32: the two can differ by one code
       where float32 rounding of the quotient crosses a half-way point, and by more once
       ``|q| > 2**24`` (float32 no longer holds every integer there);
    3. round half to even, saturate to int32 in float64, then cast.

    Zero point is 0, so ``dequantize(q, s, 0) == q * s``. ValueError for non-finite ``bias``.
    """
    bias = _as_numpy(bias, np.float64)
    if not np.isfinite(bias).all():
        raise ValueError("bias contains NaN or inf; cannot quantize it to int32")
    scale = bias_scale(input_scale, weight_scale)
    scale_axis = None if scale.size == 1 else axis
    scale = broadcast_param(scale.astype(np.float64), "weight_scale", bias.shape, scale_axis)
    q = np.clip(np.round(bias / scale), INT32_MIN, INT32_MAX)
    return np.asarray(q, dtype=np.int32)
