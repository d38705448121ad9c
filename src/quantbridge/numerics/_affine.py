"""Affine quantization ``r = scale * (q - zero_point)``: quantize, dequantize, fake-quantize.

One implementation serves numpy arrays and torch tensors (see ``_xp``); both give bit-identical
results because every step is a correctly rounded IEEE operation or an exact one.

Parameters are per tensor (``axis=None``, one element), per channel (1-D, laid out along
``axis`` of the data, which may be negative) or blocked (``block_size=B`` with ``axis``: the
data's rank, ``ceil(n / B)`` blocks along ``axis``, group-wise weights of opset 21's
``DequantizeLinear(block_size=B)`` and ONNX Runtime's ``MatMulNBits``), exactly as ONNX
QuantizeLinear / DequantizeLinear. A blocked parameter is expanded element-wise first
(``_xp.expand_blocks``: element ``i`` along ``axis`` uses block ``i // B``), then every formula
below runs unchanged, element by element:

.. math:: r_{\\ldots i \\ldots} = s_{\\ldots \\lfloor i/B \\rfloor \\ldots}
          (q_{\\ldots i \\ldots} - z_{\\ldots \\lfloor i/B \\rfloor \\ldots})

``scale`` must be positive and finite; this is not checked here (it would force a device sync
on tensors) -- ``choose_qparams`` only produces such scales.
"""

from __future__ import annotations

import numpy as np

from ._xp import Array, _torch_of, _xp, as_compute_float, as_like, broadcast_param


def _check_range(qmin: int, qmax: int) -> None:
    if int(qmin) != qmin or int(qmax) != qmax or qmin > qmax:
        raise ValueError(f"need integers qmin <= qmax, got qmin={qmin!r}, qmax={qmax!r}")


def quantize(
    x: Array, scale: Array, zero_point: Array, qmin: int, qmax: int, axis: int | None = None,
    block_size: int | None = None,
) -> Array:  # fmt: skip
    """Affine quantization, ONNX QuantizeLinear semantics, codes returned as floats.

    .. math:: q = \\mathrm{clip}(\\mathrm{round}(x / s) + z,\\ q_{min},\\ q_{max})

    Order of operations, all in the compute dtype ``F`` (float32 for float32 / float16 /
    bfloat16 / integer inputs and Python scalars; float64 for float64 inputs):

    1. ``scale`` and ``zero_point`` are cast to ``F`` (exact for zero points and float32
       scales; a wider scale, e.g. a Python float, is rounded to ``F`` as ONNX stores it);
    2. ``t = x / scale``                -- one correctly rounded IEEE division (not ``x * (1/s)``);
    3. ``t = round(t)``                 -- round half to even (ties 0.5 -> 0, 1.5 -> 2, -2.5 -> -2);
    4. ``t = t + zero_point``           -- exact whenever the result can land inside the grid;
    5. ``q = clip(t, qmin, qmax)``      -- saturation in the wide float type, so +inf -> qmax,
                                           -inf -> qmin, 3e9 -> qmax, -3e9 -> qmin;
    6. NaN policy: ``q = zero_point`` where ``x`` is NaN (it dequantizes to 0.0).

    The result has dtype ``F`` and holds integer values in ``[qmin, qmax]``; callers cast it to
    the storage dtype (``storage_dtype(scheme)``) -- the cast is then exact.

    Reference behaviour of the peers (tested in ``tests/numerics``): ONNX Runtime 1.32's CPU
    QuantizeLinear agrees bit for bit on every finite and infinite input, but maps NaN to the
    *type minimum* (-128 for int8, 0 for uint8, -32768 for int16, -8 for int4) whatever the zero
    point; ``onnx.reference`` does the same for NaN and also wraps +inf / 3e9 to the type
    minimum (it casts to int32 before clipping). We keep NaN -> zero_point: a NaN should not turn
    into the most negative value of the range. A NaN at a quantizer is a bug upstream that the two
    then show differently (up to ``zero_point - qmin`` steps apart): calibration refuses NaN, and
    placement keeps divisors float (``torch._ops.DIVISOR_INPUTS``), the source seen so far (0 / 0
    in EfficientViT's LiteMLA, 131 steps apart in ONNX Runtime).
    """
    _check_range(qmin, qmax)
    qmin, qmax = int(qmin), int(qmax)  # numpy integers would not mix with torch.clip everywhere
    xp = _xp(x)
    x = as_compute_float(x)
    scale = broadcast_param(as_like(scale, x), "scale", tuple(x.shape), axis, block_size)
    zero_point = broadcast_param(
        as_like(zero_point, x), "zero_point", tuple(x.shape), axis, block_size
    )
    with np.errstate(over="ignore"):  # x / scale -> +-inf is the saturation path, not an error
        q = xp.asarray(x / scale)  # numpy turns 0-d results into scalars; keep an array
    # step 6 on the quotient, in place (no copy of the input): NaN / s = NaN -> 0 = 0 / s, so
    # round(0) + z = z (z lies in [qmin, qmax]); +-inf kept. Steps 3-5 then run in place on the
    # one new array.
    if isinstance(q, np.ndarray):
        np.nan_to_num(q, copy=False, nan=0.0, posinf=np.inf, neginf=-np.inf)
    else:
        q.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    xp.round(q, out=q)
    q += zero_point
    xp.clip(q, qmin, qmax, out=q)
    return q


def dequantize(
    q: Array, scale: Array, zero_point: Array, axis: int | None = None,
    block_size: int | None = None,
) -> Array:  # fmt: skip
    """Affine dequantization, ONNX DequantizeLinear semantics.

    .. math:: r = (q - z) \\cdot s

    ``q`` (any integer dtype, or float holding integer codes) is cast to ``F`` (float32, or
    float64 for float64 ``q``), then ``(q - zero_point)`` is computed in ``F`` -- exact, since
    codes and zero points have at most 16 bits -- and multiplied by ``scale`` (cast to ``F``)
    with one correctly rounded multiplication. No clipping. Result dtype ``F``.
    """
    q = as_compute_float(q)
    scale = broadcast_param(as_like(scale, q), "scale", tuple(q.shape), axis, block_size)
    zero_point = broadcast_param(
        as_like(zero_point, q), "zero_point", tuple(q.shape), axis, block_size
    )
    return (q - zero_point) * scale


def fake_quantize(
    x: Array, scale: Array, zero_point: Array, qmin: int, qmax: int, axis: int | None = None,
    block_size: int | None = None,
) -> Array:  # fmt: skip
    """Quantize then dequantize: ``dequantize(quantize(x, ...), ...)``, the formulas composed.

    .. math:: \\hat{x} = (\\mathrm{clip}(\\mathrm{round}(x / s) + z, q_{min}, q_{max}) - z) \\cdot s

    Dtype ``F`` as in ``quantize``. NaN maps to ``0.0`` (via ``zero_point``). This is what a
    QuantizeLinear -> DequantizeLinear pair computes in ONNX Runtime (except for NaN, see
    ``quantize``). Note torch's ``fake_quantize_per_tensor_affine`` multiplies by ``1/scale``
    instead of dividing, which can differ by one code near ties; this function follows ONNX.
    """
    if axis is None and block_size is None:
        fast = _per_tensor_cpu(x, scale, zero_point, qmin, qmax)
        if fast is not None:
            return fast
    q = quantize(x, scale, zero_point, qmin, qmax, axis, block_size)
    # dequantize in place on the fresh codes: (q - z) * s, as ``dequantize`` computes it (an
    # add / clip / subtract with scalar bounds costs less than one clip with per-element tensor
    # bounds: 2.4 vs 5.8 ms on 8x64x112x112, one thread)
    q -= broadcast_param(as_like(zero_point, q), "zero_point", tuple(q.shape), axis, block_size)
    q *= broadcast_param(as_like(scale, q), "scale", tuple(q.shape), axis, block_size)
    return q


def _per_tensor_cpu(x: Array, scale: Array, zero_point: Array, qmin: int, qmax: int):
    """``fake_quantize`` of a CPU tensor with one scale and zero point in 5 passes instead of 7.

    Bit for bit the composition: ``clip(round(t) + z, qmin, qmax) - z`` is
    ``clip(round(t), qmin - z, qmax - z)`` (``z`` an integer: the add and the subtract are exact
    wherever the clip does not decide; NaN -> ``t = 0`` as in ``quantize``), and ``(q - z) * s``
    is written by one ``torch.add(0, c, alpha=s)``: the same correctly rounded product, plus
    ``+0.0``, which turns a ``-0.0`` code (``round(-0.3)``) into ``+0.0`` as the composition's
    ``(-0.0 + z) - z`` does. 8x64x112x112 float32, one thread: 11.5 vs 14.5-19 ms. None where it
    does not apply (numpy, other devices, a tensor autograd records, several parameters, and
    tracing -- fake tensors, torch.compile -- where reading the scale as a number would break
    the graph).
    """
    torch = _torch_of(x)
    if (
        torch is None
        or type(x) not in (torch.Tensor, torch.nn.Parameter)  # FakeTensor: no float(scale)
        or torch.compiler.is_compiling()
        or x.device.type != "cpu"
        or (x.requires_grad and torch.is_grad_enabled())
    ):
        return None
    _check_range(qmin, qmax)
    x = as_compute_float(x)
    scale, zero_point = as_like(scale, x), as_like(zero_point, x)
    if scale.numel() != 1 or zero_point.numel() != 1:
        return None
    scale = scale.reshape(())
    z = float(zero_point.reshape(()))
    q = x / scale
    q.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    q.round_()
    q.clamp_(int(qmin) - z, int(qmax) - z)
    return torch.add(q.new_zeros(()), q, alpha=float(scale), out=q)
