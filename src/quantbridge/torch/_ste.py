"""The straight-through estimators of fake quantization: one small ``autograd.Function`` each,
forward and backward formulas in its docstring (``FakeQuantizeSTE`` for fixed-range quantizers,
``LearnedStepSTE`` for LSQ). The forward of both is ``numerics.fake_quantize``."""

from __future__ import annotations

import math

import torch

from ..numerics import dequantize, expand_blocks, fake_quantize


class FakeQuantizeSTE(torch.autograd.Function):
    """Fake quantization with the clipped straight-through estimator.

    Forward: ``y = (clip(round(x / s) + z, qmin, qmax) - z) * s`` (``numerics.fake_quantize``).

    Backward: ``dL/dx = dL/dy * 1[(qmin - z) * s <= x <= (qmax - z) * s]`` - rounding is treated as
    identity inside the representable range and the gradient is zero where the value saturates.
    No gradient flows to ``scale`` or ``zero_point`` (fixed-range quantizers).

    Blocked parameters (``block_size``, group-wise weights): the same mask, written on the codes,
    ``1[qmin <= round(x / s) + z <= qmax]`` with ``s`` and ``z`` expanded per element; it holds
    for negative scales too (ONNX Runtime's symmetric block quantizer writes them).
    """

    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin: int, qmax: int, axis: int | None,
                block_size: int | None = None):  # fmt: skip
        if ctx.needs_input_grad[0] and block_size is not None:
            shape = tuple(x.shape)
            s = expand_blocks(scale, "scale", shape, axis, block_size)
            z = expand_blocks(zero_point, "zero_point", shape, axis, block_size)
            codes = torch.round(x.detach() / s) + z
            ctx.save_for_backward((codes >= qmin) & (codes <= qmax))
        elif ctx.needs_input_grad[0]:  # the mask is all backward needs: one bool per element
            param_axis = None if scale.ndim == 0 else 0
            lo = dequantize(torch.full_like(scale, qmin), scale, zero_point, param_axis)
            hi = dequantize(torch.full_like(scale, qmax), scale, zero_point, param_axis)
            lo, hi = _along(lo, x.ndim, axis), _along(hi, x.ndim, axis)
            ctx.save_for_backward((x >= lo) & (x <= hi))
        return fake_quantize(x, scale, zero_point, qmin, qmax, axis, block_size)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask, None, None, None, None, None, None


def _reduce_to(t: torch.Tensor, like: torch.Tensor, axis: int | None) -> torch.Tensor:
    """Sum ``t`` down to the shape of a per-tensor (``()``) or per-channel (``(C,)``) parameter."""
    if like.ndim == 0:
        return t.sum()
    dims = [d for d in range(t.ndim) if d != axis % t.ndim]
    return t.sum(dim=dims)


def _along(p: torch.Tensor, ndim: int, axis: int | None) -> torch.Tensor:
    if p.ndim == 0:
        return p
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return p.reshape(shape)


class LearnedStepSTE(torch.autograd.Function):
    """Fake quantization with a learned step size and offset (LSQ, Esser et al. 2020; LSQ+,
    Bhalgat et al. 2020).

    Forward: ``y = numerics.fake_quantize(x, s, z, qmin, qmax)`` with the integer zero point
    ``z = clip(round(z_f), qmin, qmax)`` of the learned float offset ``z_f``.

    Backward, with ``t = x / s``, ``q = round(t) + z`` and ``inside = qmin <= q <= qmax``:

    * ``dy/dx   = 1[inside]``
    * ``dy/ds   = g * (round(t) - t)`` inside, ``g * (qmin - z)`` below, ``g * (qmax - z)`` above
    * ``dy/dz_f = 0`` inside, ``-s`` outside (straight through the rounding of ``z_f``)

    where ``g = 1 / sqrt(n * qmax)`` is LSQ's gradient scale (``n`` = elements per scale).
    """

    @staticmethod
    def forward(ctx, x, scale, zero_point_f, qmin: int, qmax: int, axis: int | None):
        z = zero_point_f.detach().round().clamp(qmin, qmax)
        s = scale.detach()
        y = fake_quantize(x, s, z, qmin, qmax, axis)
        if any(ctx.needs_input_grad[:3]):
            sb, zb = _along(s, x.ndim, axis), _along(z, x.ndim, axis)
            t = x.detach() / sb
            codes = torch.round(t) + zb
            below, above = codes < qmin, codes > qmax
            codes.clamp_(qmin, qmax)
            ctx.save_for_backward(t, codes, below, above, s, z)
        ctx.qmin, ctx.qmax, ctx.axis = qmin, qmax, axis
        return y

    @staticmethod
    def backward(ctx, grad):
        t, codes, below, above, scale, z = ctx.saved_tensors
        axis, qmax = ctx.axis, ctx.qmax
        outside = below | above
        inside = ~outside
        zb = _along(z, t.ndim, axis)
        # inside: round(t) - t = (codes - z) - t ; outside: codes - z is qmin - z or qmax - z
        ds = (codes - zb) - t * inside
        n = t.numel() / max(scale.numel(), 1)
        g = 1.0 / math.sqrt(n * max(abs(qmax), 1))
        grad_scale = _reduce_to(grad * ds, scale, axis) * g
        grad_zero = None
        if ctx.needs_input_grad[2]:
            grad_zero = -_reduce_to(grad * outside, scale, axis) * scale
        return grad * inside, grad_scale, grad_zero, None, None, None
