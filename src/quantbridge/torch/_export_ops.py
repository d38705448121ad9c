"""The torch side of export: two custom ops and the context that makes quantizers emit them.

``torch.ops.quantbridge.quantize_dequantize(x, scale, zero_point, qmin, qmax, axis)`` and
``torch.ops.quantbridge.dequantize(q, scale, zero_point, axis)`` compute exactly what
``numerics.fake_quantize`` / ``numerics.dequantize`` compute, so a model in export mode still runs
in torch with the same outputs. Their only purpose is to survive ``torch.export`` as single nodes
whose inputs are the quantizer's own buffers (scale, zero point in its storage dtype, integer
weight), so that the ONNX exporter's translation table (``quantbridge.onnx.exporter._translate``) turns each
into QuantizeLinear / DequantizeLinear with integer initializers - no float weight is ever
exported and no quantization parameter is guessed from the graph.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn

from ..numerics import dequantize, fake_quantize, storage_dtype
from ._bias_fit import fit_bias_grids
from ._fakequant import BiasQuantizer, ConstantQuantizer, QState, Quantizer, WeightQuantizer
from ._nodes import weight_of


@torch.library.custom_op("quantbridge::quantize_dequantize", mutates_args=())
def quantize_dequantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    axis: int | None,
) -> torch.Tensor:
    return fake_quantize(x, scale, zero_point, qmin, qmax, axis)


@quantize_dequantize.register_fake
def _(x, scale, zero_point, qmin, qmax, axis):
    return torch.empty_like(x)


@torch.library.custom_op("quantbridge::dequantize", mutates_args=())
def dequantize_op(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None
) -> torch.Tensor:
    return dequantize(q, scale, zero_point, axis)


@dequantize_op.register_fake
def _(q, scale, zero_point, axis):
    return torch.empty_like(q, dtype=torch.float32)


@torch.library.custom_op("quantbridge::dequantize_blocked", mutates_args=())
def dequantize_blocked(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, block_size: int
) -> torch.Tensor:
    """``numerics.dequantize`` with blocked parameters (``BlockWeightQuantizer``'s export)."""
    return dequantize(q, scale, zero_point, axis, block_size)


@dequantize_blocked.register_fake
def _(q, scale, zero_point, axis, block_size):
    return torch.empty_like(q, dtype=torch.float32)


_TORCH_DTYPES = {
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.uint16): torch.uint16,
}


def torch_storage_dtype(quantizer: Quantizer) -> torch.dtype:
    return _TORCH_DTYPES[np.dtype(storage_dtype(quantizer.scheme))]


def _set(module: nn.Module, name: str, value: torch.Tensor) -> None:
    module.register_buffer(name, value, persistent=False)


@contextlib.contextmanager
def export_mode(model: nn.Module):
    """Within the block, quantizers of ``model`` emit the export ops with precomputed integers.

    Export is this context, not a quantizer state: it gives each quantizer its export tensors
    (non-persistent buffers, which a quantizer's forward takes as the sign to emit the export
    ops) and removes them on the way out."""
    touched: list[tuple[nn.Module, list[str]]] = []
    for m in model.modules():  # QAT weights follow the weight: their current range
        if isinstance(m, WeightQuantizer) and m.enabled and m.qstate is QState.CALIBRATING:
            m(weight_of(model, m.weight_name))
    # every int32 bias fits its grid: a bias trained or corrected since the freeze, or a weight
    # range followed just now, raises its weight step where needed (``_bias_fit``)
    fit_bias_grids(model, following=True)
    try:
        for m in model.modules():
            names = _prepare(model, m)
            if names:
                touched.append((m, names))
        yield model
    finally:
        for m, names in touched:
            for n in names:
                delattr(m, n)


def _prepare(model: nn.Module, m: nn.Module) -> list[str]:
    if isinstance(m, ConstantQuantizer):  # an integer initializer -> DequantizeLinear
        if not m.enabled:
            return []
        c = model.get_buffer(m.constant_name)
        dtype = torch_storage_dtype(m)
        _set(m, "export_qvalue", m.quantize_integers(c).to(dtype))
        _set(m, "export_scale", m.current_scale().clone())
        _set(m, "export_zero_point", m.integer_zero_point().to(dtype))
        return ["export_qvalue", "export_scale", "export_zero_point"]
    if isinstance(m, WeightQuantizer):
        if not m.enabled:
            return []
        w = weight_of(model, m.weight_name)  # (a following range is set in export_mode)
        dtype = torch_storage_dtype(m)
        _set(m, "export_qweight", m.quantize_integers(w).to(dtype))
        _set(m, "export_scale", m.current_scale().clone())
        _set(m, "export_zero_point", m.integer_zero_point().to(dtype))
        return ["export_qweight", "export_scale", "export_zero_point"]
    if isinstance(m, Quantizer):
        if not m.enabled or m.qstate is QState.CALIBRATING:
            return []
        _set(m, "export_scale", m.current_scale().clone())
        _set(m, "export_zero_point", m.integer_zero_point().to(torch_storage_dtype(m)))
        return ["export_scale", "export_zero_point"]
    if isinstance(m, BiasQuantizer):
        if not m.active():
            return []
        b = model.get_parameter(m.bias_name)
        scale = m.bias_scale().detach().clone()
        _set(m, "export_qbias", m.integer_bias(b))
        _set(m, "export_scale", scale)
        _set(m, "export_zero_point", torch.zeros(scale.shape, dtype=torch.int32))
        m.export_axis = 0 if scale.numel() > 1 else None
        return ["export_qbias", "export_scale", "export_zero_point"]
    return []


def code_extremes(quantizer: Quantizer, x: torch.Tensor) -> torch.Tensor:
    """The codes ``codes(x)`` holds at its extremes: per channel (or per
    tensor) the code of the smallest and of the largest value, flattened.

    Exact without quantizing ``x``: ``quantize`` is monotone non-decreasing in ``x`` (a correctly
    rounded division by a positive scale, round half to even, an exact zero-point addition, a
    clip), so the smallest and largest codes are those of the smallest and largest values. One
    reduction over ``x`` instead of a quantization of it (the export's saturation check read every
    weight's codes: 21 full quantizations of a ResNet-18's 11.7M weights). NaN is the exception
    (it quantizes to the zero point, not as an extreme): a tensor holding one is quantized whole.
    """
    axis = quantizer.axis
    codes = quantizer.quantize_integers
    if hasattr(quantizer, "flat"):  # stacked experts: the codes of the flat view [E * O, K]
        x, codes = quantizer.flat(x), quantizer.quantize_flat
    dims = [] if axis is None else [d for d in range(x.ndim) if d != axis % x.ndim]
    if getattr(quantizer, "block_size", None) is not None:  # blocked: every code
        return codes(x).reshape(-1)
    if x.numel() == 0 or (axis is not None and not dims):
        return codes(x).reshape(-1)
    if axis is None:
        lo, hi = torch.aminmax(x)
    else:
        lo, hi = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    if torch.isnan(lo).any() or torch.isnan(hi).any():
        return codes(x).reshape(-1)
    return torch.cat([codes(v).reshape(-1) for v in (lo, hi)])
