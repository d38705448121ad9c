"""Quantization-aware training: prepare a float model for QAT, then freeze observers and BN.

The QAT life cycle of a ``QuantModel``:

1. ``prepare_qat(model, recipe, calib_data)`` captures the model *without* folding batch norms,
   places quantizers (a conv's output quantizer sits after its batch norm and activation),
   calibrates activation ranges on ``calib_data``, and returns the model in training mode:
   batch norms use batch statistics, dropout is active (``QuantModel.train`` flips those ops in
   the captured graph, as ``model.train()`` would in the user's model).
   Activation ranges then follow the training data by a moving average (``learn_scales=False``)
   or are learned by LSQ (``learn_scales=True``); weight ranges follow the weights each step.
2. ``freeze_observers(qmodel)`` fixes every range that is still moving (weights from their
   current values, activations at their current average).
3. ``freeze_batchnorm(qmodel)`` stops batch-norm statistics and folds each batch norm into its
   conv: ``W' = W k``, ``b' = (b - mu) k + beta`` with ``k = gamma / sqrt(var + eps)``. The weight
   quantizer's per-channel scale is multiplied by ``|k|`` - the same integer weights then
   represent the folded weights exactly - and a bias created by the fold gets an int32 quantizer.

Training can continue after each step; export folds remaining batch norms itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..recipe import Recipe, resolve_recipe
from ._bias_fit import fit_bias_grids
from ._collective import is_distributed
from ._fakequant import ConstantQuantizer, QState, Quantizer, WeightQuantizer
from ._model import QuantModel
from ._nodes import weight_of
from ._passes import fold_batchnorm, set_graph_training
from ._placement import CONTAINER, quantize_new_bias
from ._quantize import calibrate_and_freeze

aten = torch.ops.aten


def prepare_qat(
    model: nn.Module,
    recipe: Recipe | str | dict | None = "int8",
    calib_data: Iterable | None = None,
    *,
    transform: Callable[[Any], Any] | None = None,
    forward_loop: Callable[[nn.Module], None] | None = None,
    learn_scales: bool = False,
    max_batches: int | None = None,
    progress: bool | None = None,
    dynamic: str = "batch",
) -> QuantModel:
    """A ``QuantModel`` ready for quantization-aware training (see the module docstring).

    Under ``torch.distributed``, call it on every rank with that rank's shard of ``calib_data``:
    the calibration statistics are combined across ranks as in ``quantize``. Wrapped in
    ``DistributedDataParallel``, the moving-average ranges follow the min / max over every
    rank's batch, so scales stay equal on all ranks (``quantbridge.torch._distributed``).
    """
    recipe = resolve_recipe(recipe)
    qmodel = calibrate_and_freeze(
        model,
        calib_data,
        recipe,
        transform,
        forward_loop,
        max_batches,
        progress,
        dynamic,
        fold_bn=False,
        freeze_weights=False,
    )
    for m in getattr(qmodel, CONTAINER).children():
        if isinstance(m, ConstantQuantizer):
            continue  # constants do not train: their grid stays the one set at placement
        if isinstance(m, WeightQuantizer):
            if learn_scales:
                m.compute_from(weight_of(qmodel, m.weight_name))
                m.make_learnable()
        elif isinstance(m, Quantizer):
            if learn_scales:
                m.make_learnable()
            else:
                m.track()
    return qmodel.train()


def freeze_observers(qmodel: QuantModel) -> QuantModel:
    """Stop every range from moving: weights fixed from their current values, activations at
    their current moving average. Learned (LSQ) scales keep learning."""
    for m in getattr(qmodel, CONTAINER).children():
        if isinstance(m, WeightQuantizer) and m.qstate is not QState.LEARNED:
            m.compute_from(weight_of(qmodel, m.weight_name))
        elif isinstance(m, Quantizer):
            m.stop_tracking()
    fit_bias_grids(qmodel)  # every int32 bias fits its (now fixed) grid
    return qmodel


def freeze_batchnorm(qmodel: QuantModel) -> QuantModel:
    """Stop batch-norm statistics and fold every batch norm into its conv (see module docstring)."""

    def follow(conv: torch.fx.Node, k: torch.Tensor) -> None:
        w_call = conv.args[1]
        if w_call.op == "call_module" and str(w_call.target).startswith(CONTAINER + "."):
            wq = qmodel.get_submodule(w_call.target)
            _rescale(wq, k.abs().float(), qmodel)
        b = conv.args[2] if len(conv.args) > 2 else None
        if isinstance(b, torch.fx.Node) and b.op == "get_attr":
            point = quantize_new_bias(qmodel, conv, qmodel.qb_recipe)
            if point is not None:
                qmodel.qb_points.append(point)

    qmodel.qb_bn_frozen = True
    set_graph_training(qmodel, bn=False, dropout=qmodel.training)
    _broadcast_batchnorm_statistics(qmodel)
    fold_batchnorm(qmodel, on_fold=follow)
    return qmodel


def _broadcast_batchnorm_statistics(qmodel: QuantModel) -> None:
    """Under torch.distributed every rank's running statistics differ (each saw its own batches);
    take rank 0's so that the folded weights are identical everywhere. A collective: every rank
    must call ``freeze_batchnorm``. Wrap the model in a new DDP afterwards (parameters changed)."""
    if not is_distributed():
        return
    for node in qmodel.graph.nodes:
        if node.target is aten.batch_norm.default:
            for stat in node.args[3:5]:  # running_mean, running_var
                if isinstance(stat, torch.fx.Node) and stat.op == "get_attr":
                    dist.broadcast(qmodel.get_buffer(stat.target), src=0)


def _rescale(wq: WeightQuantizer, k: torch.Tensor, qmodel: QuantModel) -> None:
    """The weight was multiplied by ``k`` per output channel: move ``|k|`` into the scale (and
    the learned ``log_scale``) so the integer codes stay the same."""
    with torch.no_grad():
        if wq.axis is None:  # per-tensor: |k| differs per channel, so recompute from the weight
            if wq.qstate is not QState.CALIBRATING:
                wq.compute_from(weight_of(qmodel, wq.weight_name))
            if wq.qstate is QState.LEARNED:
                wq.log_scale.copy_(torch.log(wq.scale))
            return
        wq.scale = wq.scale * k
        if wq.qstate is QState.LEARNED:
            wq.log_scale.add_(torch.log(k))


def folded_copy(qmodel: QuantModel) -> QuantModel:
    """A deep copy with batch norms frozen and folded (for export), the original untouched."""
    if not any(n.target is aten.batch_norm.default for n in qmodel.graph.nodes):
        return qmodel
    clone = copy.deepcopy(qmodel)
    return freeze_batchnorm(clone.eval())
