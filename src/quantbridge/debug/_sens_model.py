"""What ``sensitivity`` measures, from a torch model or an ONNX file: the float module, its
calibration and evaluation batches, the base recipe, and the evaluation of a model on the set.

* A torch model takes batches as ``qb.quantize`` does (a tensor, a tuple of positional inputs, a
  dict of keyword inputs); ``labels`` (one per evaluation sample) are optional, for ``top1``.
  A ``QuantModel`` is ranked as it is (its recipe, its scales; no calibration data needed) and
  cannot be repaired: the repair quantizes the float model again.
* An ONNX file (path or ``ModelProto``) is imported (``qb.import_onnx``) and quantized exactly as
  ``quantbridge quantize`` does it (``quantize_onnx``: the same checked ``CalibrationSet``, the
  same dynamic dimensions, the float output head kept by recipe rules unless ``float_head=False``),
  so a recipe found here gives the same model in ``quantbridge quantize --recipe``. Its
  evaluation data is an ``.npz`` / mapping keyed by graph input name; an array named ``labels``
  there holds the labels.

A recipe is a ``Recipe``, a preset name, its dict, or a ``.yaml`` / ``.json`` file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..onnx import import_onnx
from ..onnx.quantizer import CalibrationSet, graph_inputs
from ..onnx.quantizer._head import head_rules
from ..onnx.quantizer._quantize_onnx import dynamic_mode, load_model
from ..recipe import Recipe, resolve_recipe
from ..torch import QuantModel, quantize
from ..torch._batches import as_call
from ._sens_metrics import Outputs

LABELS_KEY = "labels"


def load_recipe(recipe) -> Recipe:
    """A ``Recipe`` from a Recipe, preset name, dict, or ``.yaml`` / ``.json`` file path."""
    return resolve_recipe(recipe)


@dataclass
class Subject:
    """A float module with its data: everything needed to quantize and evaluate it."""

    module: nn.Module
    calib: list
    eval_batches: list
    labels: np.ndarray | None
    recipe: Recipe  # the base recipe, with the float-head rules of an ONNX file
    dynamic: str
    ops: dict[str, str]  # layer (module path) -> op / module type
    name: str

    def quantize(self, recipe: Recipe, progress: bool | None = None) -> QuantModel:
        if isinstance(self.module, QuantModel):  # given quantized: ranked as it is
            return self.module
        return quantize(self.module, self.calib, recipe, progress=progress, dynamic=self.dynamic)

    def op_of(self, layer: str) -> str:
        return self.ops.get(layer, "?")

    def run(self, model: nn.Module, need_logits: bool) -> Outputs:
        """``model`` on every evaluation batch, gathered as ``Outputs`` (float64)."""
        out = Outputs()
        with torch.no_grad():
            for i, batch in enumerate(self.eval_batches):
                args, kwargs = as_call(batch, i)
                leaves = [
                    t
                    for t in tree_flatten(model(*args, **kwargs))[0]
                    if isinstance(t, torch.Tensor) and t.is_floating_point()
                ]
                if not leaves:
                    raise ValueError("the model returns no float tensor to measure")
                rows = leaves[0].shape[0] if leaves[0].dim() else 1
                flat = [t.detach().double().reshape(rows, -1).numpy() for t in leaves]
                out.flat.append(np.concatenate(flat, axis=1))
                if need_logits:
                    if leaves[0].dim() != 2:
                        raise ValueError(
                            f"metric top1 needs a first output of shape (batch, classes); the "
                            f"model's has shape {tuple(leaves[0].shape)}"
                        )
                    out.logits.append(flat[0])
        return out


def from_torch(
    model: nn.Module, calib: Iterable, eval_data: Iterable, labels, recipe, dynamic: str
) -> Subject:
    prequantized = isinstance(model, QuantModel)
    if (calib is None and not prequantized) or eval_data is None:
        raise ValueError("sensitivity needs calibration data and evaluation data (eval_data=...)")
    source = model.__dict__.get("_qb_source") if prequantized else model
    ops = {name: type(m).__name__ for name, m in (source or model).named_modules()}
    eval_batches = list(eval_data)
    if not eval_batches:
        raise ValueError("sensitivity: the evaluation data holds no batch")
    return Subject(
        module=model.eval(),
        calib=[] if calib is None else list(calib),
        eval_batches=eval_batches,
        labels=None if labels is None else np.asarray(labels),
        recipe=model.qb_recipe if prequantized else load_recipe(recipe),
        dynamic=dynamic,
        ops=ops,
        name=type(model).__name__,
    )


def from_onnx(
    src, calib, eval_data, recipe, batch_size: int | None, float_head: bool = True
) -> Subject:
    model: onnx.ModelProto = load_model(src)
    inputs = graph_inputs(model)
    arrays = _arrays(eval_data)
    labels = arrays.pop(LABELS_KEY, None)
    module = import_onnx(model)
    base = load_recipe(recipe)
    if float_head:
        base = base.with_rules(*head_rules(model, module.onnx_names))
    op_types = {n.name: n.op_type for n in model.graph.node}
    ops = {attr: op_types.get(node, "?") for attr, node in module.onnx_names.items()}
    return Subject(
        module=module.eval(),
        calib=list(CalibrationSet(calib, inputs, batch_size)),
        eval_batches=list(CalibrationSet(arrays, inputs, batch_size)),
        labels=labels,
        recipe=base,
        dynamic=dynamic_mode(inputs),
        ops=ops,
        name=os.fspath(src) if isinstance(src, (str, os.PathLike)) else model.graph.name,
    )


def _arrays(source) -> dict[str, np.ndarray]:
    """Evaluation arrays keyed by input name (plus ``labels``) from an ``.npz`` or a mapping."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file() or path.suffix != ".npz":
            raise ValueError(
                f"evaluation data {str(path)!r}: expected an .npz file keyed by graph input name"
            )
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    if isinstance(source, dict):
        return {k: np.asarray(v) for k, v in source.items()}
    raise TypeError(
        f"evaluation data for an ONNX model is an .npz path or a dict of arrays, got "
        f"{type(source).__name__}"
    )


def is_onnx(model) -> bool:
    return isinstance(model, onnx.ModelProto) or (
        isinstance(model, (str, os.PathLike)) and Path(model).suffix == ".onnx"
    )
