"""Bias quantization to int32 with ``scale = input_scale * weight_scale`` and zero point 0, and
the weight scale that keeps such a bias inside int32 (``fit_weight_scale_to_bias``), and a bias
correction shrunk by its calibration noise (``shrink_bias_shift``)."""

from __future__ import annotations

import numpy as np

from ._fixed_point import INT32_MAX, INT32_MIN
from ._qparams import pow2_ceil
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


def fit_weight_scale_to_bias(
    bias: object,
    input_scale: object,
    weight_scale: object,
    axis: int = 0,
    pow2: bool = False,
) -> np.ndarray:
    """The weight scale raised, where needed, so that ``quantize_bias`` never saturates.

    A weight channel whose scale is tiny (an all-zero "dead" channel gets ``MIN_SCALE``, 2**-23)
    makes the bias step ``s = s_x * s_w`` tiny too, and ``round(b / s)`` then overflows int32
    once ``|b| > INT32_MAX * s`` (2**31 * s_x * 2**-23 = 256 * s_x): the stored bias saturates
    and the channel's output is wrong in every engine. ONNX Runtime's quantizer raises such a
    weight scale (``adjust_weight_scale_for_int32_bias``); this is the same rule, exact in
    float32:

    1. ``need = max|b|`` over the bias elements one weight scale serves (each channel along
       ``axis`` for a 1-D ``weight_scale``, the whole bias for a single one);
    2. where ``fl32(s_x * s_w) * INT32_MAX < need``: ``s_w' = need / (s_x * INT32_MAX)`` in
       float64, rounded UP to float32; then ``s_w'`` steps up one float32 ulp at a time until
       ``need / fl32(s_x * s_w') <= INT32_MAX`` (the float32 product ``bias_scale`` stores,
       so ``round(b / s)`` fits int32 and every bias code is within half a step of ``b``);
    3. ``pow2``: a raised scale is rounded up to a power of two (``pow2_ceil``: still enough).

    Other scales are returned unchanged (bit for bit). Only the scale moves: the caller
    requantizes the weight with it (an all-zero channel keeps its codes, 0). Returns float32
    with ``weight_scale``'s shape. ValueError as ``bias_scale`` / ``quantize_bias``.
    """
    bias = _as_numpy(bias, np.float64)
    if not np.isfinite(bias).all():
        raise ValueError("bias contains NaN or inf; cannot fit a weight scale to it")
    scale = bias_scale(input_scale, weight_scale)  # checks both scales
    s_x = _as_numpy(input_scale, np.float32).reshape(())
    s_w = _as_numpy(weight_scale, np.float32).copy()
    if s_w.size == 1:
        need = np.abs(bias).max(initial=0.0).reshape(s_w.shape)
    else:
        axis = axis % bias.ndim if bias.ndim else 0
        moved = np.moveaxis(np.atleast_1d(bias), axis, 0)
        need = np.abs(moved).reshape(moved.shape[0], -1).max(axis=1, initial=0.0)
        need = need.reshape(s_w.shape)
    low = scale.astype(np.float64) * INT32_MAX < need
    if not low.any():
        return s_w
    raised = need[low] / (float(s_x) * INT32_MAX)
    up = raised.astype(np.float32)
    up = np.where(up.astype(np.float64) < raised, np.nextafter(up, np.float32(np.inf)), up)
    if pow2:
        up = pow2_ceil(up.astype(np.float64)).astype(np.float32)
    for _ in range(8):  # float32 rounding of the product: at most a step or two
        short = need[low] / (s_x * up).astype(np.float64) > INT32_MAX
        if not short.any():
            break
        bumped = pow2_ceil(np.nextafter(up, np.float32(np.inf)).astype(np.float64))
        up = np.where(
            short, bumped.astype(np.float32) if pow2 else np.nextafter(up, np.float32(np.inf)), up
        )
    s_w[low] = up
    return s_w


def shrink_bias_shift(errors: object, counts: object) -> np.ndarray:
    """A bias correction shrunk by its own sampling noise (float64, one value per channel).

    ``errors[n, c]``: sample ``n``'s mean output error (float minus quantized) in channel ``c``
    over its ``counts[n]`` positions (``counts``: shape ``(N,)`` or ``(N, C)``; a sample with 0
    positions is left out). Samples are the unit of noise: positions within one sample (an
    image's pixels, a sentence's tokens) are correlated, samples are drawn independently.

    1. ``c = sum_n w_n e_n / sum_n w_n`` with ``w_n = counts[n]``: the plain correction (the
       mean error over every position);
    2. its squared standard error, the usual estimate for a weighted mean of ``N`` independent
       samples: ``se^2 = N / (N - 1) * sum_n w_n^2 (e_n - c)^2 / (sum_n w_n)^2`` (equal
       weights: ``s^2 / N``, ``s^2`` the unbiased sample variance of the ``e_n``);
    3. ``shift = c * c^2 / (c^2 + se^2)``; 0 where ``c^2 + se^2 == 0``; ``c`` unchanged where
       fewer than 2 samples count (no estimate of the noise).

    Why (a Wiener filter per channel): model ``c = mu + eps``, ``mu`` the true mean error and
    ``eps`` the calibration noise, mean 0 and variance ``se^2``. A shift ``a * c`` leaves the
    expected squared bias ``(1 - a)^2 mu^2 + a^2 se^2`` on new data, least at
    ``a = mu^2 / (mu^2 + se^2)``; ``c^2`` stands in for the unknown ``mu^2``. For
    ``|c| >> se`` the shift is ``c`` (relative change ``se^2 / c^2``); for pure noise
    (``mu = 0``) its expected square is 0.47 ``se^2`` against the plain correction's ``se^2``
    (normal noise; the positive-part ``(1 - se^2 / c^2)_+ c`` would give 0.33, but up to
    1.45 ``se^2`` where ``|mu|`` is 2-3 ``se``, against this rule's 1.24 at most).
    """
    e = _as_numpy(errors, np.float64)
    if e.ndim != 2:
        raise ValueError(f"errors must be (samples, channels), got shape {e.shape}")
    w = _as_numpy(counts, np.float64)
    w = np.broadcast_to(w.reshape(-1, 1) if w.ndim == 1 else w, e.shape)
    if not (np.isfinite(e).all() and np.isfinite(w).all() and (w >= 0).all()):
        raise ValueError("errors must be finite and counts finite and >= 0")
    total = w.sum(0)
    if not (total > 0).all():
        raise ValueError("every channel needs at least one position (counts sum to 0)")
    c = (w * e).sum(0) / total
    n = (w > 0).sum(0)
    se2 = np.where(n > 1, n / np.maximum(n - 1, 1) * (w**2 * (e - c) ** 2).sum(0) / total**2, 0.0)
    power = c * c + se2
    return np.where(power > 0, c * (c * c) / np.where(power > 0, power, 1.0), 0.0)
