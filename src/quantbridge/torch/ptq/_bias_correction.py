"""Empirical bias correction (Nagel et al. 2019, section 4.2; NNCF's "fast bias correction").

Quantization shifts the mean of a layer's output: the rounding errors ``W - W_hat`` of an
output channel need not cancel against the mean input (per-tensor weights on depthwise convs are
the known case: few weights per channel, large steps), and the quantized input's mean drifts from
the float one as errors pass through ReLUs. The shift moves every later layer. Correction, after
``freeze``, layer by layer in graph order (each layer sees the corrections before it):

.. math::
   b_c \\leftarrow b_c + \\operatorname{mean}_{n,\\,\text{spatial}}\big(y^{float}_c - y^{quant}_c\big)

with ``y^float`` the layer's output (before its output quantizer) in the float model and
``y^quant`` in the quantized model with the corrections so far, both over the calibration data:
the quantized model's mean output then matches the float model's at every corrected layer. The
int32 bias quantizer rounds the corrected bias (its scale does not depend on the bias). Cost: one
float pass, then per layer one quantized pass up to that layer (about half a model pass each on
average). Layers without a bias are left alone (a new bias would be a new input of the op).
"""

from __future__ import annotations

from functools import partial

import torch

from .._fakequant import BiasQuantizer, WeightQuantizer
from .._model import float_mode
from ._graph import CONV_OPS, PLAIN_WEIGHTED, attr_node, get_tensor, record


def _corrected_layers(qmodel: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Conv / linear nodes whose weight and bias go through active quantizers."""
    found = []
    for node in qmodel.graph.nodes:
        if node.op != "call_function" or node.target not in PLAIN_WEIGHTED or len(node.args) < 3:
            continue
        w, b = node.args[1], node.args[2]
        if not all(isinstance(a, torch.fx.Node) and a.op == "call_module" for a in (w, b)):
            continue
        wq, bq = qmodel.get_submodule(w.target), qmodel.get_submodule(b.target)
        if not (isinstance(wq, WeightQuantizer) and isinstance(bq, BiasQuantizer)):
            continue
        if wq.enabled and attr_node(w) is not None and attr_node(b) is not None:
            found.append(node)
    return found


def _channel_means(node: torch.fx.Node, y: torch.Tensor, sums: dict, counts: dict) -> None:
    axis = 1 if node.target in CONV_OPS else y.ndim - 1
    y = y.double().movedim(axis, -1).reshape(-1, y.shape[axis])
    sums[node] = sums.get(node, 0) + y.sum(0)
    counts[node] = counts.get(node, 0) + y.shape[0]


def correct_bias(qmodel: torch.fx.GraphModule, batches) -> int:
    """Correct each quantized layer's float bias in place so its mean output over ``batches``
    ((args, kwargs) calls) matches the float model's. Returns the layers corrected."""
    layers = _corrected_layers(qmodel)
    if not layers:
        return 0
    float_sums: dict = {}
    float_counts: dict = {}
    with float_mode(qmodel):
        record(
            qmodel,
            batches,
            set(layers),
            partial(_channel_means, sums=float_sums, counts=float_counts),
        )
    for node in layers:
        sums: dict = {}
        counts: dict = {}
        record(
            qmodel,
            batches,
            {node},
            partial(_channel_means, sums=sums, counts=counts),
            stop_after=node,
        )
        shift = float_sums[node] / float_counts[node] - sums[node] / counts[node]
        with torch.no_grad():
            bias = get_tensor(qmodel, attr_node(node.args[2]))
            bias += shift.to(bias.dtype)
    return len(layers)
