"""Weight scales raised so that every int32 bias fits (``numerics.fit_weight_scale_to_bias``).

An int32 bias is stored at ``input_scale * weight_scale``. A weight channel that is nearly dead
(weights under ``qmax * 2**-23``, e.g. a batch norm slimmed to gamma ~1e-6 folded into its conv;
an all-zero channel gets scale 1.0) gets the floor scale 2**-23, so its bias step is
``input_scale * 2**-23`` and a bias above ``256 * input_scale`` would saturate: the channel's
output (about its bias) would be wrong in every engine.
``fit_bias_grids`` raises such weight scales once the input scale is known, as ONNX Runtime's
quantizer does: such a channel's codes are 0 or tiny, so the change costs nothing measurable. A
live channel (a weight step above the floor) whose bias still would saturate is raised too (its
weights keep fewer levels, far better than a saturated bias) and a one-line warning names the
layer; an asymmetric weight grid (its zero point would move) is left as it is and the warning
says its bias saturates.

Called after PTQ's freeze and bias correction (``_quantize``), by QAT's ``freeze_observers`` and
by export (``_export_ops.export_mode``) for the weights QAT keeps following.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn

from ..numerics import MIN_SCALE, fit_weight_scale_to_bias
from ._fakequant import BiasQuantizer, QState

__all__ = ["fit_bias_grid", "fit_bias_grids"]


def fit_bias_grids(model: nn.Module, following: bool = False) -> None:
    """``fit_bias_grid`` for every active int32 bias of ``model`` whose weight grid is fixed
    (frozen or learned; also weights that follow their tensor with ``following=True``)."""
    for m in model.modules():
        if isinstance(m, BiasQuantizer):
            fit_bias_grid(model, m, following)


def fit_bias_grid(model: nn.Module, bq: BiasQuantizer, following: bool = False) -> bool:
    """Raise the weight scale of ``bq``'s op where its int32 bias would saturate; True if it
    changed. Warns (one line, naming the layer and the fix) for channels with nonzero weights."""
    wq = bq.weight_quantizer
    if not bq.active() or (wq.qstate is QState.CALIBRATING and not following):
        return False
    bias = _tensor(model, bq.bias_name)
    s_x, s_w = bq.input_quantizer.current_scale(), wq.current_scale()
    pow2 = wq.scheme.scale_constraint == "pow2"
    fitted = fit_weight_scale_to_bias(bias, s_x, s_w, pow2=pow2)
    raised = fitted != s_w.cpu().numpy().astype(np.float32)
    if not raised.any():
        return False
    channels = np.flatnonzero(raised) if raised.ndim else np.arange(1)
    # live: a grid set by the weights' own range, above the floor (a floor-scale channel is dead
    # or nearly: all-zero weights get 1.0, weights under qmax * 2**-23 the floor, codes tiny)
    steps = np.atleast_1d(s_w.cpu().numpy())
    weight = _tensor(model, wq.weight_name)
    live = [int(c) for c in channels if steps[c] > MIN_SCALE and _has_weights(weight, wq, int(c))]
    if not wq.scheme.symmetric:
        warnings.warn(
            f"{wq.name}: the int32 bias of output channel(s) {channels.tolist()[:8]} saturates "
            f"(|bias| up to {float(bias.abs().max()):.4g} > 2**31 * input step {float(s_x):.3g}"
            " * weight step); fix: a symmetric weight scheme (its step can then be raised), or "
            "keep the layer float with Rule(pattern=..., skip=True)",
            stacklevel=2,
        )
        return False
    if live:
        ratio = float(np.max(fitted[raised] / s_w.cpu().numpy()[raised]))
        warnings.warn(
            f"{wq.name}: the int32 bias of output channel(s) {live[:8]} would saturate (|bias| "
            f"up to {float(bias.abs().max()):.4g} at input step {float(s_x):.3g}); their weight "
            f"step is raised up to {ratio:.3g}x so it fits, leaving those weights fewer levels. "
            "Fine if the bias dominates the channel; otherwise fix the layer's scale (e.g. fold "
            "a following constant into it) or keep it float with Rule(pattern=..., skip=True)",
            stacklevel=2,
        )
    scale = torch.as_tensor(fitted).to(wq.scale.device)
    if wq.qstate is QState.CALIBRATING:  # follows its weight: scale recomputed next call
        wq.scale = scale
        wq.__dict__.pop("_cache", None)
    else:
        wq.set_qparams(scale, wq.integer_zero_point())
    return True


def _has_weights(weight: torch.Tensor, wq, channel: int) -> bool:
    """Whether output channel ``channel`` (the whole weight for a per-tensor grid) is nonzero."""
    if wq.axis is None:
        return bool(weight.count_nonzero())
    return bool(weight.select(wq.axis, channel).count_nonzero())


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter (or, in an imported graph, buffer) ``name``, detached."""
    try:
        return model.get_parameter(name).detach()
    except AttributeError:
        return model.get_buffer(name).detach()
