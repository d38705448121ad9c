"""Weights an int16 pair sum cannot saturate (``Recipe.pair_safe_weights``).

x86 CPUs without VNNI add two adjacent uint8 x int8 products into an int16 with saturation
(``quantbridge._platform``): 8-bit weights then run several LSB off in ONNX Runtime and OpenVINO
there, and 7-bit weights (``int8_avx2``, the default preset's) avoid it by doubling every weight's
step. This pass keeps 8-bit grids and bounds only what saturates: after the weight scales are
frozen (and ``weight_ranges`` ran), for every conv / linear with per-output-channel symmetric
signed weights and more than one input channel per group, each channel's scale and codes become
``numerics.pair_bounded_scales`` / ``pair_bounded_codes`` of its weights laid out in the
engines' reduction order: ONNX Runtime's ``QLinearConv`` reorders a weight ``(M, C/g, kh, kw)``
to ``(kh, kw, C/g)`` per output channel and pairs neighbours there (adjacent input channels at
one tap when ``C/g`` is even, oneDNN's pairs too); a linear pairs neighbours along its input.
``B = numerics.pair_bound`` of the activation grid's code count (128 for uint8).

Depthwise convs (one input channel per group) are left alone: MLAS's depthwise kernel
accumulates in int32. Transposed convs run in float in ONNX Runtime. The rounded weight is
written into the parameter (``s * q``, so fake quantization and export give ``q``), its float
value kept for ``float_mode`` (``keep_float_weight``), so the bias correction after it corrects
the projection's mean error as it does the rounding's.

Measured (PP-OCRv4 det, bench quick data, the split-ranges row, calibration repeat 0, an AVX2
EPYC without VNNI, ORT 1.32): torch fake quantization 19.03 dB, ORT node by node 18.88, ORT
fused 18.00; the same file's codes projected afterwards (no bias correction refit) run fused
within 0.03 dB of node by node (13.46 / 13.43): the engine's pairs are these.
"""

from __future__ import annotations

import torch

from ...numerics import pair_bound, pair_bounded_codes, pair_bounded_scales
from .._fakequant import WeightQuantizer
from .._model import keep_float_weight
from .._nodes import weight_of
from ._weight_ranges import _layers as weight_range_layers

aten = torch.ops.aten


def _layers(qmodel) -> list[tuple[torch.fx.Node, WeightQuantizer]]:
    """(node, weight quantizer) of each conv / linear whose weights the pass bounds: those of
    ``weight_ranges`` (symmetric signed per-output-channel grids), less depthwise convs."""
    return [
        (node, q)
        for node, q in weight_range_layers(qmodel)
        # depthwise (or one input channel): int32 kernel, no pair sums
        if not ((w := weight_of(qmodel, q.weight_name)).ndim > 2 and w.shape[1] == 1)
    ]


def engine_rows(w: torch.Tensor) -> torch.Tensor:
    """``w`` as (output channels, K) in the engines' reduction order: a conv weight
    ``(M, C/g, *k)`` as ``(M, *k, C/g)`` flattened, a linear weight as it is."""
    if w.ndim <= 2:
        return w.reshape(w.shape[0], -1)
    return w.movedim(1, -1).reshape(w.shape[0], -1)


def from_engine_rows(rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of ``engine_rows`` for a weight of ``shape``."""
    if len(shape) <= 2:
        return rows.reshape(shape)
    moved = (shape[0], *shape[2:], shape[1])
    return rows.reshape(moved).movedim(-1, 1)


def bound_weight_pairs(qmodel, activation_levels: int) -> int:
    """Re-choose the scales and codes of ``qmodel``'s bounded layers (module docstring) for
    activation codes in ``[0, activation_levels]``; returns the layers changed."""
    bound = pair_bound(activation_levels)
    layers = _layers(qmodel)
    for _, q in layers:
        param = weight_of(qmodel, q.weight_name)
        w = param.detach()
        rows = engine_rows(w).double().numpy()
        scale = pair_bounded_scales(rows, q.qmin, q.qmax, bound)
        codes = pair_bounded_codes(rows / scale.astype("float64")[:, None], q.qmin, q.qmax, bound)
        scale_t = torch.from_numpy(scale).to(q.scale.dtype)
        q.set_qparams(scale_t, torch.zeros_like(q.zero_point))
        shape = (-1,) + (1,) * (w.ndim - 1)
        rounded = from_engine_rows(torch.from_numpy(codes).to(w.dtype), w.shape)
        rounded = rounded * scale_t.to(w.dtype).reshape(shape)
        float_weight = w.clone()
        with torch.no_grad():
            param.copy_(rounded)
        keep_float_weight(q, param, float_weight)
    return len(layers)
