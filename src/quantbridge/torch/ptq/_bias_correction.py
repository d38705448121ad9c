"""Empirical bias correction (Nagel et al. 2019, section 4.2; NNCF's "fast bias correction").

Quantization shifts the mean of a layer's output: the rounding errors ``W - W_hat`` of an
output channel need not cancel against the mean input (per-tensor weights on depthwise convs are
the known case: few weights per channel, large steps), and the quantized input's mean drifts from
the float one as errors pass through ReLUs. The shift moves every later layer. Two corrections,
after ``freeze``, both adding a per-output-channel shift to the float bias (the int32 bias
quantizer then rounds the corrected bias; its scale does not depend on the bias):

* ``Recipe.bias_correction=True`` (one float pass, as NNCF's fast bias correction): each layer's
  own error, on the float model's input ``x`` to it,

  .. math:: \\Delta b_c = \\operatorname{mean}_{n,\\,\\text{spatial}}
            \\big(W * x - \\hat W * Q(x)\\big)_c

* ``"sequential"`` (Nagel et al. 2019's empirical correction, layer by layer in graph order, each
  layer seeing the corrections before it): the float model's mean output minus the quantized
  model's, ``mean(y^float_c - y^quant_c)``, which also removes the drift that arrives from
  upstream. One float pass (a batch at a time, for the float means), then ONE quantized pass
  over every calibration batch (``_sequential``): at a corrected layer, once every batch has
  reached it, its shift goes into the float bias and the layer runs again (its bias through the
  int32 bias quantizer) before any later node reads it; the same shifts as a quantized pass per
  layer (test: within float32 rounding of the bias), at about the cost of one quantized pass
  instead of one per layer. Memory: ``_sequential``'s docstring.

Padded positions (``Recipe.bias_correction_mask``, sequential only): a transformer's batch is
padded to a common length, and a padded token's activations differ from a real token's; the
attention mask keeps them out of every real token's result, but a mean over all positions is
dominated by them (MiniLM-L6, bench quick: 77 % of the calibration positions are padding; the
shift from all positions raised the held-out error on real tokens at all 36 linears, its mean
part about 10x). With the mask's name, a linear's means run over the positions whose mask entry
is nonzero, where its output's leading dimensions are the mask's (batch, tokens); elsewhere
(convolutions, other shapes) over every position as before.

Output check (``Recipe.bias_correction_check``, either variant): a shift that lowers each
layer's own mean error can still raise the model's output error (MiniLM-L6: the padded-token
masked sequential shifts lower the held-out error of 33 of the 36 linears, yet the sentence
embeddings' squared error rises 18.3 -> 19.9, mean cosine 0.857 -> 0.844). With the check, the
output squared error (every output tensor, float64 sums) against the float model on the
calibration batches is measured before and after, and the corrected biases are kept only if it
fell; otherwise the old biases are restored. Cost: one float and two quantized passes, a batch
at a time.
Why there (measured, not proven causal): past MiniLM's first block 30-99 % of a linear's mean
error is a gain term (error proportional to the output), which a constant fits at the mean token
only; the output error rises on the calibration sentences themselves (not overfitting).

Shrinkage (``Recipe.bias_correction_shrink``, sequential only, opt-in): from few samples a
channel's mean error is noisy (61-76 % of MobileNetV2-style's channels have ``|c| < se``), so the
shift is ``numerics.shrink_bias_shift`` of per-sample errors (samples: index 0 of the output):
``c * c^2 / (c^2 + se^2)``. Measured mixed (bench row 'default with noise-shrunk bias
correction'): MiniLM +0.004-0.007 cosine, CNNs +-2 dB by repeat; not the default.

Layers without a bias are left alone (a new bias would be a new input of the op).

The one-pass shift needs only the mean of each weight tap's input: for a convolution
``mean_c(W * x) = sum_{i, k} W[c, i, k] m[i, k]`` with ``m[i, k]`` the mean over the batch and the
output positions of the (zero-padded) input value tap ``k`` of input channel ``i`` reads
(``tap_means``: the batch summed once, then one strided slice per kernel offset), and for a
linear layer ``W mean(x)``. So the layer's two convolutions per batch (float and quantized) are
replaced by ``k`` slice means, in float64 (exact to float64 rounding, where the convolutions
rounded in float32).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from .._fakequant import BiasQuantizer, Quantizer, WeightQuantizer
from .._model import float_mode
from .._progress import stage
from .._threads import one_thread
from ._graph import (
    CONV_OPS,
    PLAIN_WEIGHTED,
    attr_node,
    conv_geometry,
    get_tensor,
    groups_of,
    record,
)
from ._sequential import _add_to_bias, _channel_means, _correct_sequentially, position_masks

aten = torch.ops.aten


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


def tap_means(
    node: torch.fx.Node, x: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, int] | None:
    """(mean input of each weight tap in float64, number of output positions averaged) for
    ``node`` (a conv / linear) called on ``x`` with weight ``w``; None for forms it does not
    cover (unbatched convolutions, keyword arguments)."""
    if node.target is aten.linear.default:
        rows = x.reshape(-1, x.shape[-1])
        return rows.sum(0, dtype=torch.float64) / rows.shape[0], rows.shape[0]
    nd = w.ndim - 2
    if node.target not in CONV_OPS or x.ndim != nd + 2 or node.kwargs:
        return None  # the two convolutions instead
    stride, padding, dilation = conv_geometry(node, nd)
    batch, kernel = x.shape[0], w.shape[2:]
    x = F.pad(x.sum(0, dtype=torch.float64), [p for p in reversed(padding) for _ in (0, 1)])
    out = [(x.shape[1 + j] - dilation[j] * (kernel[j] - 1) - 1) // stride[j] + 1 for j in range(nd)]
    count = batch * math.prod(out)
    means = torch.empty((x.shape[0], *kernel), dtype=torch.float64)
    spatial = tuple(range(1, 1 + nd))
    for offset in itertools.product(*(range(k) for k in kernel)):
        taps = tuple(
            slice(o * d, o * d + s * (n - 1) + 1, s)
            for o, d, s, n in zip(offset, dilation, stride, out, strict=True)
        )
        means[(slice(None), *offset)] = x[(slice(None), *taps)].sum(spatial)
    return means / count, count


def mean_output(w: torch.Tensor, means: torch.Tensor, groups: int) -> torch.Tensor:
    """Per output channel, the mean of ``W * x`` (no bias) from ``tap_means``, in float64."""
    w = w.double()
    if w.ndim == 2:
        return w @ means
    co, ci = w.shape[0], w.shape[1]
    wg = w.reshape(groups, co // groups, ci, *w.shape[2:])
    mg = means.reshape(groups, 1, ci, *w.shape[2:])
    return (wg * mg).flatten(2).sum(-1).reshape(co)


def _quantized(qmodel, arg, value: torch.Tensor) -> torch.Tensor:
    """``value`` through the quantizer that reads it in the graph (enabled for this call)."""
    if not (isinstance(arg, torch.fx.Node) and arg.op == "call_module"):
        return value
    quantizer = qmodel.get_submodule(arg.target)
    if not isinstance(quantizer, Quantizer):
        return value
    enabled, quantizer.enabled = quantizer.enabled, True
    try:
        return quantizer(value)
    finally:
        quantizer.enabled = enabled


def _local_shifts(qmodel, layers, batches) -> dict:
    """One float pass: per layer, mean of ``op(x, W) - op(Q(x), Q(W))`` on the float input."""
    sums: dict = {}
    counts: dict = {}
    # node -> Q(W): the weights do not change here. Only Q(W), in float32: W, Q(W) and both in
    # float64 for every layer held 5x the model's weights to the end of the pass (+222 MiB peak on
    # ResNet-18-style; the cost figure's peak 1.08 -> 1.36x ONNX Runtime's)
    quantized_weights: dict = {}

    def on_args(node, args):
        with one_thread():  # small float64 ops: the pool's threads would spin (``_threads``)
            layer_shift(node, args)

    def layer_shift(node, args):
        x, w = args[0], args[1]
        if node not in quantized_weights:
            quantized_weights[node] = _quantized(qmodel, node.args[1], w)
        wq = quantized_weights[node]
        xq = _quantized(qmodel, node.args[0], x)
        taps = tap_means(node, x, w)
        if taps is None:
            diff = node.target(x, w, None, *args[3:]) - node.target(xq, wq, None, *args[3:])
            _channel_means(node, diff, sums, counts)
            return
        float_means, count = taps
        quant_means, _ = tap_means(node, xq, wq)
        groups = groups_of(node)
        diff = mean_output(w.double(), float_means, groups) - mean_output(
            wq.double(), quant_means, groups
        )
        sums[node] = sums.get(node, 0) + diff * count
        counts[node] = counts.get(node, 0) + count

    with float_mode(qmodel):
        record(qmodel, batches, set(layers), lambda n, v: None, on_args)
    return {node: sums[node] / counts[node] for node in sums}


def _outputs(qmodel, batches) -> list[list[torch.Tensor]]:
    """Per batch, the model's output tensors (flattened), a batch at a time."""
    found = []
    with torch.no_grad():
        for args, kwargs in batches:
            leaves = tree_flatten(qmodel(*args, **kwargs))[0]
            found.append([v for v in leaves if isinstance(v, torch.Tensor)])
    return found


def output_error(qmodel, batches, reference: list) -> float:
    """Sum over ``batches`` and output elements of (quantized - ``reference``)^2, in float64."""
    total = 0.0
    for got, want in zip(_outputs(qmodel, batches), reference, strict=True):
        total += sum(
            float((g.double() - w.double()).pow(2).sum()) for g, w in zip(got, want, strict=True)
        )
    return total


def _biases(qmodel, layers) -> dict:
    return {node: get_tensor(qmodel, attr_node(node.args[2])).detach().clone() for node in layers}


def correct_bias(
    qmodel: torch.fx.GraphModule,
    batches,
    sequential: bool = False,
    progress: bool | None = None,
    mask: str = "",
    check: bool = False,
    shrink: bool = False,
) -> int:
    """Correct each quantized layer's float bias in place from ``batches`` ((args, kwargs)
    calls), a variant of the module docstring; ``mask`` (sequential: the keyword input marking real
    positions), ``check`` (keep them only if the output error on ``batches`` fell), ``shrink``
    (sequential: shifts shrunk by their noise). Returns the layers corrected (0 if restored)."""
    if mask and not sequential:
        raise ValueError(
            f"bias correction mask {mask!r}: only the sequential correction reads it; use"
            " bias_correction='sequential' or no mask"
        )
    if shrink and not sequential:
        raise ValueError(
            "bias correction shrink: only the sequential correction keeps per-sample errors;"
            " use bias_correction='sequential' or bias_correction_shrink=False"
        )
    layers = _corrected_layers(qmodel)
    if not layers:
        return 0
    batches = list(batches)
    if check:
        with stage("bias correction: output error before", progress):
            with float_mode(qmodel):
                reference = _outputs(qmodel, batches)
            before, saved = output_error(qmodel, batches, reference), _biases(qmodel, layers)
    if sequential:
        _correct_sequentially(
            qmodel, list(layers), batches, progress, position_masks(batches, mask), shrink
        )
    else:
        with stage(f"bias correction: one pass, {len(layers)} layers", progress):
            shifts = _local_shifts(qmodel, layers, batches)
        for node, shift in shifts.items():
            _add_to_bias(qmodel, node, shift)
    if not check:
        return len(layers)
    after = output_error(qmodel, batches, reference)
    kept = after < before
    with stage(
        f"bias correction: output error {before:.6g} -> {after:.6g}, "
        + ("kept" if kept else "biases restored"),
        progress,
    ):
        if not kept:
            with torch.no_grad():
                for node, bias in saved.items():
                    get_tensor(qmodel, attr_node(node.args[2])).copy_(bias)
    return len(layers) if kept else 0
