"""Per-channel weight ranges by weighted squared rounding error (``Recipe.weight_ranges``).

After ``freeze`` (min-max weight scales), for every conv / linear whose weights are per output
channel on a symmetric signed grid: each channel's scale becomes the clipped one with the least
``numerics.weighted_rounding_error`` (``numerics.weighted_mse_scales``), with

* ``"mse"``: every weight counted alike (the squared weight error; no data needed);
* ``"output"``: weight ``j`` counted by ``E[x_j^2]``, the mean square of the input it multiplies
  (a conv's tap of input channel ``c`` at kernel offset ``k``, zero padding included, as the
  bias correction's ``tap_means`` on ``x^2``) on the float model's inputs over the calibration
  batches: the layer's output error from its weights, less the inputs' cross terms. With bias
  correction in the recipe, ``Var(x_j) = E[x_j^2] - E[x_j]^2`` instead: the correction removes
  the error's mean (``e . E[x]``), so what is left is its variance.

Measured on PP-OCRv4 det (bench quick data, the split-ranges row + this option, ONNX Runtime
fused, calibration repeats 0 / 1 / 2, 2026-12-02): min-max 20.11 / 19.21 / 19.87 dB; "output"
with E[x^2] 19.83 / 19.37 / 19.13; with Var (as now) 20.51 / 18.89 / 19.81. Not robust: the
repeats move both ways by up to 0.4 dB, the size of the differences between close variants,
so it stays opt-in and no preset uses it.

Other weights (per tensor, asymmetric, learnable, transposed convs) keep their min-max scales.
Formulas: ``numerics._weight_ranges``.
"""

from __future__ import annotations

import torch

from ...numerics import PerChannel, weighted_mse_scales
from .._fakequant import WeightQuantizer
from .._model import float_mode
from .._nodes import weight_of
from ._bias_correction import tap_means
from ._graph import CONV_OPS, groups_of, record

aten = torch.ops.aten
MODES = ("minmax", "mse", "output")


def _layers(qmodel) -> list[tuple[torch.fx.Node, WeightQuantizer]]:
    found = []
    for node in qmodel.graph.nodes:
        if node.op != "call_function" or node.target not in (*CONV_OPS, aten.linear.default):
            continue
        arg = node.args[1] if len(node.args) > 1 else None
        if not (isinstance(arg, torch.fx.Node) and arg.op == "call_module"):
            continue
        q = qmodel.get_submodule(arg.target)
        if not isinstance(q, WeightQuantizer) or not q.enabled or q.learnable:
            continue
        s = q.scheme
        if not (isinstance(s.granularity, PerChannel) and s.symmetric and s.signed) or q.axis != 0:
            continue
        found.append((node, q))
    return found


def _importance(qmodel, layers, batches, centered: bool) -> dict:
    """Per layer, ``E[x_j^2]`` (``centered``: ``Var(x_j)``) of each weight's input as a
    (channels, fan-in) float64 array."""
    sums: dict = {}
    counts: dict = {}
    firsts: dict = {}

    def on_args(node, args):
        x, w = args[0], args[1]
        with torch.no_grad():
            taps = tap_means(node, x.double() * x.double(), w)
            first = tap_means(node, x.double(), w) if centered else None
        if taps is None:
            raise ValueError(f"weight_ranges='output': layer {node.name} has a form it cannot read")
        mean, count = taps
        sums[node] = sums.get(node, 0) + mean * count
        counts[node] = counts.get(node, 0) + count
        if first is not None:
            firsts[node] = firsts.get(node, 0) + first[0] * count

    with float_mode(qmodel):
        record(qmodel, batches, {n for n, _ in layers}, lambda n, v: None, on_args)
    out = {}
    for node, q in layers:
        w = weight_of(qmodel, q.weight_name)
        d = (sums[node] / counts[node]).reshape(-1)
        if centered:
            d = (d - (firsts[node] / counts[node]).reshape(-1) ** 2).clamp_min(0)
        groups = groups_of(node) if node.target in CONV_OPS else 1
        per_group = d.reshape(groups, 1, -1).expand(groups, w.shape[0] // groups, -1)
        out[node] = per_group.reshape(w.shape[0], -1).numpy()
    return out


def fit_weight_ranges(qmodel, mode: str, batches=None, centered: bool = False) -> int:
    """Set the weight scales of ``qmodel``'s per-channel layers by ``mode`` (module docstring);
    ``batches`` ((args, kwargs) calibration calls) for ``"output"``, ``centered`` (the recipe
    has bias correction) for ``Var(x_j)``. Returns the layers set."""
    if mode not in MODES:
        raise ValueError(f"Recipe.weight_ranges={mode!r}: use one of {MODES}")
    if mode == "minmax":
        return 0
    layers = _layers(qmodel)
    if mode == "output":
        if not batches:
            raise ValueError("weight_ranges='output' needs calibration batches; got none")
        importance = _importance(qmodel, layers, list(batches), centered)
    for node, q in layers:
        w = weight_of(qmodel, q.weight_name).detach()
        d = importance[node] if mode == "output" else None
        w2 = w.double().reshape(w.shape[0], -1).numpy()
        scale = torch.from_numpy(weighted_mse_scales(w2, q.qmin, q.qmax, d))
        q.set_qparams(scale.to(q.scale.dtype), torch.zeros_like(q.zero_point))
    return len(layers)
