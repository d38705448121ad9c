"""``quantize``: capture, fold, place, calibrate, freeze - the post-training quantization flow."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from ..recipe import Recipe, resolve_recipe
from ._batches import as_call, check_like, describe, input_spec, iter_calls, nonfinite_source
from ._bias_fit import fit_bias_grids
from ._bn_affine import batchnorm_as_conv
from ._capture import (
    capture,
    declared_dims_fixed,
    dtype_fix,
    refuse_written_inputs,
    user_stacklevel,
)
from ._distributed import sync_observers
from ._fakequant import Quantizer, WeightQuantizer
from ._float_model import check_float_module
from ._fold_affine import fold_affine as fold_affine_ops
from ._fold_affine_input import fold_affine_inputs
from ._model import QuantModel
from ._nodes import weight_of
from ._ops import PAD_OPS, PAD_OWN_GRID
from ._outliers import outlier_residuals, outlier_rules
from ._passes import fold_batchnorm, own_parameters, tensor_storages
from ._placement import CONTAINER, place_quantizers
from ._progress import progress_bar, stage
from ._ranges import mismatched_concats
from ._reader_ranges import limit_observed_ranges
from ._signature import bind_first_batch, cast_float64, check_call_hook, float_dtype
from .ptq._adaround import adaround, keep_calls, record_calls
from .ptq._bias_correction import correct_bias
from .ptq._data import collect_calls, needs_batches
from .ptq._distill import distill
from .ptq._equalize import equalize
from .ptq._pair_bound import bound_weight_pairs
from .ptq._smoothquant import replay, smooth
from .ptq._split_ranges import split_ranges
from .ptq._weight_ranges import fit_weight_ranges


class _FirstCall(Exception):
    def __init__(self, args: tuple, kwargs: dict):
        self.args_, self.kwargs_ = args, kwargs


class _Recorder(nn.Module):
    """Stands in for the model inside a user's forward_loop to learn its input signature."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        raise _FirstCall(args, kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


def prepare(
    model: nn.Module,
    example_args: tuple,
    example_kwargs: dict,
    recipe: Recipe,
    dynamic: str = "batch",
    fold_bn: bool = True,
    *,
    separate_concats: list[str] | None = None,
    progress: bool | None = None,
    ptq_batches: list | None = None,
    smoothed: list[str] | None = None,
    split: dict | None = None,
    explicit_padding: bool = True,
    pads_on_grid: bool = True,
) -> QuantModel:
    """Capture ``model``, fold batch norms, place observing quantizers (no calibration yet).

    Concats whose inputs' ranges on the example call are too far apart for one scale stay float
    on separately quantized inputs (``_ranges``); ``separate_concats`` gives their fx names
    instead of measuring (``load`` replays the saved decision). ``ptq_batches`` ((args, kwargs)
    calls; default: the example) feed the recipe's float methods (``torch.ptq``); ``smoothed``
    names the tensors an earlier SmoothQuant divided (``load`` replays them). ``explicit_padding``:
    see ``capture`` (``load`` passes False for checkpoints older than it). ``pads_on_grid``: zero
    padding shares its input's grid (``_ops.PAD_OPS``; False: each pad gets its own quantizer, as
    placed before, for older checkpoints). With ``fold_bn``,
    ``recipe.fold_affine`` folds constant ``* k`` / ``+ t`` next to a conv/linear into it."""
    if (fixed := declared_dims_fixed(model, dynamic)) is not None:
        warnings.warn(fixed, stacklevel=user_stacklevel())
    was_training = model.training
    _set_mode(model, False)
    try:
        with stage(
            f"capturing {type(model).__name__} (torch.export, dynamic={dynamic!r})", progress
        ):
            gm = capture(
                model, example_args, example_kwargs, dynamic, explicit_padding=explicit_padding
            )
    finally:
        _set_mode(model, was_training)
    refuse_written_inputs(model, gm)  # before any batch runs
    shared = tensor_storages(gm)  # the capture's tensors are the user's model's
    if fold_bn:  # folding writes new tensors, never the captured ones
        fold_batchnorm(gm)
        batchnorm_as_conv(gm)  # the batch norms no conv / linear took: depthwise 1x1 convs
    if fold_bn and recipe.fold_affine:  # constant x * k + t next to a layer
        fold_affine_ops(gm)
        fold_affine_inputs(gm)  # and a constant affine a conv/linear reads
    own_parameters(gm, shared)  # a copy of what is still shared (a folded weight is not)
    batches = ptq_batches or [(example_args, example_kwargs)]
    if recipe.equalize:  # weights only: a loaded checkpoint's own weights replace these
        equalize(gm, batches)
    if recipe.split_ranges:  # before placement: the split convs get their own quantizers
        acts, weights = recipe.activations.scheme, recipe.weights.scheme
        levels = (acts.qmax - acts.qmin, weights.qmax)
        split = split_ranges(gm, batches, split, levels)  # ``load`` replays the recorded split
    alphas = None
    if recipe.smoothquant is not None and smoothed is None:
        smoothed, alphas = smooth(gm, recipe, batches)
    elif recipe.smoothquant is not None:
        replay(gm, recipe, smoothed)
    if recipe.float_outlier_residuals:  # measured once, kept as rules (``load`` replays them)
        found = outlier_residuals(gm, example_args, example_kwargs)
        recipe = replace(recipe.with_rules(*outlier_rules(found)), float_outlier_residuals=False)
    if separate_concats is None:
        separate_concats = sorted(mismatched_concats(gm, example_args, example_kwargs))
    if not pads_on_grid:
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in PAD_OPS:
                node.meta[PAD_OWN_GRID] = True
    points = place_quantizers(gm, recipe, frozenset(separate_concats))
    if recipe.reader_bounds:  # a value only relu / clamp / hard-swish reads: their interval
        limit_observed_ranges(gm, recipe.reader_bounds == "all")
    if not points:
        warnings.warn(
            f"nothing in {type(model).__name__} is quantized: none of its ops is one the recipe "
            "quantizes (conv, linear, matmul, add, ...) or every one is skipped by a rule; the "
            "result computes in float",
            stacklevel=user_stacklevel(),
        )
    qmodel = QuantModel(gm, recipe=recipe, points=points, source=model)
    qmodel.register_forward_pre_hook(check_call_hook, with_kwargs=True)  # one-line shape errors
    qmodel.qb_capture = {
        "inputs": input_spec(example_args, example_kwargs),
        "dynamic": getattr(gm, "qb_dynamic", dynamic),  # "batch" after a capture fallback
        "fold_bn": fold_bn,
        "separate_concats": list(separate_concats),
        "explicit_padding": explicit_padding,  # string-padding convs quantized (_conv_padding)
        "pads_on_grid": pads_on_grid,  # zero padding on its input's grid (_ops.PAD_OPS)
    }
    if getattr(model, "qb_io_names", None) is not None:  # an imported ONNX file's own names
        qmodel.qb_capture["io_names"] = model.qb_io_names
    if recipe.split_ranges:
        qmodel.qb_capture["split_ranges"] = split
    if recipe.smoothquant is not None:
        qmodel.qb_capture["smoothed"] = list(smoothed)
        if alphas is not None:
            qmodel.qb_capture["smoothquant_alphas"] = alphas
    return qmodel.eval()


def quantize(
    model: nn.Module,
    calib_data: Iterable | None = None,
    recipe: Recipe | str | dict | None = "default",
    *,
    transform: Callable[[Any], Any] | None = None,
    forward_loop: Callable[[nn.Module], None] | None = None,
    max_batches: int | None = None,
    progress: bool | None = None,
    dynamic: str = "batch",
) -> QuantModel:
    """Post-training quantization of ``model``: a ``QuantModel`` with INT8 semantics.

    ``calib_data`` is an iterable of batches (tensor = one input, tuple = positional inputs,
    dict = keyword inputs); ``transform`` maps each item to such a batch (e.g. ``lambda b: b[0]``
    for a DataLoader of ``(inputs, labels)``). Alternatively ``forward_loop(model)`` runs the
    calibration forward passes itself. Capture and calibration report on stderr (a bar on a
    terminal, one line per stage otherwise) unless ``progress=False`` or
    ``quantbridge.set_progress(False)``. ``dynamic="batch"`` lets the result take any batch size; use
    ``dynamic="all"`` when other dimensions vary too (sequence length, image size).

    The model is captured and calibrated as in eval mode (dropout off, BatchNorm on its running
    statistics) whatever its mode, and left unchanged; a ``QuantModel`` or a ScriptModule is
    refused (pass the float ``nn.Module``).

    ``recipe``: a ``Recipe``, its dict, a preset name or a ``.yaml``/``.json`` file; the
    ``"default"`` preset (7-bit per-channel weights, uint8 activations by mse, float logits, bias
    correction) was chosen by measurement: ``quantbridge.recipe`` says why. ``"int8"`` is the plain 8-bit preset with
    quantized outputs.

    Under ``torch.distributed`` (a process group of more than one rank), call it on every rank
    with that rank's shard of the data: the ranks' statistics are combined before the scales are
    frozen, so all ranks get the same scales and zero points (those of one process over all the
    shards for minmax and the histogram methods). Only some ranks quantizing? Wrap the call in
    ``quantbridge.torch._distributed.local_statistics()``.
    """
    qmodel = calibrate_and_freeze(
        model,
        calib_data,
        resolve_recipe(recipe),
        transform,
        forward_loop,
        max_batches,
        progress,
        dynamic,
    )
    return qmodel


def calibrate_and_freeze(
    model: nn.Module,
    calib_data: Iterable | None,
    recipe: Recipe,
    transform: Callable | None,
    forward_loop: Callable | None,
    max_batches: int | None,
    progress: bool | None,
    dynamic: str,
    fold_bn: bool = True,
    freeze_weights: bool = True,
) -> QuantModel:
    """Capture, place, run the calibration data, freeze: the part PTQ and QAT share. With
    ``recipe.adaround`` (PTQ only), AdaRound then sets the weights' rounding (``ptq``)."""
    ada = recipe.adaround if freeze_weights else None
    kept: list = []
    check_float_module(model)
    if forward_loop is not None:
        if calib_data is not None:
            raise ValueError("pass either calib_data or forward_loop, not both")
        try:
            forward_loop(_Recorder(model))
        except _FirstCall as first:
            example = (first.args_, first.kwargs_)
        else:
            raise ValueError("forward_loop never called the model: no calibration data")
        batches = collect_calls(forward_loop, model) if needs_batches(recipe) else None
        qmodel = prepare(
            model, *example, recipe, dynamic, fold_bn, progress=progress, ptq_batches=batches
        )
        with torch.no_grad():
            forward_loop(qmodel)
    else:
        calls = _cast_calls(iter_calls(calib_data, transform, max_batches), float_dtype(model))
        first = next(calls, None)
        if first is None:
            raise ValueError("calibration data is empty: quantize needs at least one batch")
        if ada is not None:
            calls = keep_calls(calls, kept, ada.calib_batches)
        _, args0, kwargs0 = first
        kept.append((args0, kwargs0))
        bind_first_batch(model, args0, kwargs0)
        batches = None
        if needs_batches(recipe):  # the methods run the data more than once: keep it
            rest = list(calls)
            batches = [(args0, kwargs0), *((a, k) for _, a, k in rest)]
            calls = iter(rest)
        qmodel = prepare(
            model, args0, kwargs0, recipe, dynamic, fold_bn, progress=progress, ptq_batches=batches
        )
        total = len(calib_data) if hasattr(calib_data, "__len__") else None
        if total is not None and max_batches is not None:
            total = min(total, max_batches)
        _calibrate(qmodel, _chain(first, calls), (args0, kwargs0), progress, total)
    sync_observers(qmodel)  # torch.distributed: combine every rank's statistics (else no-op)
    freeze(qmodel, weights=freeze_weights)
    if freeze_weights:  # PTQ only: QAT's weight ranges follow the weights
        fit_weight_ranges(qmodel, recipe.weight_ranges, batches, bool(recipe.bias_correction))
    warn_dead_ranges(qmodel)
    fit_bias_grids(qmodel)  # a dead channel's int32 bias must fit: raise its weight step
    if recipe.pair_safe_weights and freeze_weights:  # codes no int16 pair sum saturates on
        acts = recipe.activations.scheme
        bound_weight_pairs(qmodel, acts.qmax - acts.qmin)
    if ada is not None:  # learned rounding first; bias correction then measures what is left
        if forward_loop is not None:
            kept = record_calls(forward_loop, qmodel, ada.calib_batches)
        adaround(qmodel, kept, ada, progress)
    if recipe.bias_correction and freeze_weights:  # PTQ only: QAT trains its biases
        sequential = recipe.bias_correction == "sequential"
        mask, check = recipe.bias_correction_mask, recipe.bias_correction_check
        shrink = recipe.bias_correction_shrink
        correct_bias(qmodel, batches, sequential, progress, mask, check, shrink)
        fit_bias_grids(qmodel)  # the corrected biases
    if recipe.distill_steps and freeze_weights:  # last: starts from everything above
        distill(qmodel, model, batches, recipe.distill_steps, progress)
        fit_bias_grids(qmodel)  # the learned biases and weight scales
    return qmodel


def _set_mode(model: nn.Module, training: bool) -> None:
    """``model.train(training)``; ``ExportedProgram.module()`` refuses both, and runs as it was
    exported (its batch norms and dropouts fixed in the exported mode)."""
    try:
        model.train(training)
    except NotImplementedError:
        pass


def _cast_calls(calls, model_dtype):
    warned: list = []
    for i, args, kwargs in calls:
        yield i, *cast_float64(args, kwargs, model_dtype, warned)


def _chain(first, rest):
    yield first
    yield from rest


def _calibrate(qmodel: QuantModel, calls, reference, progress, total) -> None:
    qmodel.eval()
    with torch.no_grad():
        for i, args, kwargs in progress_bar(calls, progress, "calibrating", total):
            check_like(args, kwargs, *reference, i)
            try:
                qmodel(*args, **kwargs)
            except ValueError as e:
                hint = nonfinite_source(args, kwargs) if "non-finite" in str(e) else ""
                raise ValueError(f"calibration batch {i}: {e}{hint}") from None
            except (RuntimeError, AssertionError) as e:
                first = str(e).strip().splitlines()[0]
                fix = dtype_fix(first, float_dtype(qmodel))
                if fix:  # integer data the capture let through (a Linear's mm checks dtypes late)
                    raise ValueError(
                        f"calibration batch {i} {describe(args, kwargs)} does not have the dtype "
                        f"the model computes in: {first}; {fix}"
                    ) from e
                raise ValueError(
                    f"calibration batch {i} {describe(args, kwargs)} does not fit the model "
                    f"captured from {describe(*reference)}: {first}"
                ) from e


def freeze(qmodel: QuantModel, weights: bool = True) -> None:
    """Fix every quantizer's scale and zero point from what it observed (weights from themselves,
    unless ``weights=False``: QAT keeps weight ranges following the weights)."""
    container = getattr(qmodel, CONTAINER)
    for m in container.children():
        if isinstance(m, WeightQuantizer):
            if weights:
                m.compute_from(weight_of(qmodel, m.weight_name))
        elif isinstance(m, Quantizer):
            m.freeze()


def dead_ranges(qmodel: QuantModel) -> list[tuple[str, float]]:
    """(name, largest |value| seen) of every activation quantizer whose calibration saw only
    zeros, or only values under half its step: each of them quantizes every value it saw to its
    zero point, so the layers reading it compute on a constant."""
    dead = []
    for m in getattr(qmodel, CONTAINER).children():
        if not isinstance(m, Quantizer) or m.kind != "activation" or m.observer is None:
            continue
        try:
            lo, hi = m.observer.range(m.scheme)
        except ValueError:
            continue
        amax = float(np.max(np.maximum(np.abs(lo), np.abs(hi))))
        if amax < 0.5 * float(m.current_scale().min()):
            dead.append((m.name, amax))
    return dead


def warn_dead_ranges(qmodel: QuantModel) -> None:
    """One warning naming the activations whose calibrated range holds nothing but zero codes
    (``dead_ranges``): the layer is quantized, but to a constant, which no error shows."""
    dead = dead_ranges(qmodel)
    if not dead:
        return
    shown = ", ".join(f"{name!r} (max |x| {amax:.3g})" for name, amax in dead[:6])
    more = f" and {len(dead) - 6} more" if len(dead) > 6 else ""
    warnings.warn(
        f"calibration saw only zeros (or values below half a quantization step) at {len(dead)} "
        f"tensor(s): {shown}{more}; they quantize to zero, and so does everything computed from "
        "them. Check the calibration data (the inputs the model expects, normalised as in "
        "training) and the layers before them (dead or untrained weights, a BatchNorm scale of "
        "~0)",
        stacklevel=user_stacklevel(),
    )


__all__ = ["quantize", "prepare", "freeze", "as_call", "dead_ranges"]
