"""AdaRound (Nagel et al. 2020): learn, layer by layer, whether each weight rounds down or up.

Runs on a calibrated and frozen ``QuantModel`` (``quantize`` calls it when the recipe has
``adaround``). For every weighted layer (conv1d/conv2d, grouped and depthwise included, and
linear; transposed and 3-D convs keep round-to-nearest), in graph order:

1. rows: the layer's input as a matrix of rows (a conv's im2col patches, a linear's tokens),
   ``AdaRound.rows`` of them sampled from the cached calibration batches, read from the
   *quantized* model as it stands (activation quantizers on, the layers before already
   AdaRounded);
2. targets: the *float* model's output of the layer at the same positions (one float pass before
   any weight changes). This is the paper's asymmetric reconstruction: the rounding also absorbs
   the error the quantized inputs bring from upstream, which the paper measured as better than
   reconstructing from float inputs;
3. a clamp that follows the layer (relu, relu6, ``FOLDABLE_ACTIVATIONS``) is applied to both
   sides, as the paper's reconstruction through the activation function;
4. ``V`` starts at ``h(V) = frac(w / s)`` (the soft weight equals the float weight) and Adam
   minimises ``||y - y~||^2 / ||y - y_rtn||^2 + reg_weight * mean(1 - |2h - 1|^beta)`` on random
   batches of rows, ``beta`` annealed from 20 to 2 after a warm-up without regulariser;
5. the hard rounding ``floor(w / s) + (V >= 0)`` is written into the weight as its dequantized
   value (an exact grid point, so export stores exactly those integers); ``float_mode`` still
   runs the float weight (``keep_float_weight``), so the sequential bias correction after it
   corrects against the float model (it used to take the rounded weights as its float
   reference, and so undid the mean the rounding had absorbed from upstream). If it reconstructs
   the held-out fifth of the rows worse than round-to-nearest, the layer keeps round-to-nearest;
   so does a layer with fewer training rows than weights per output channel (a squeeze-excite
   conv on pooled features has one row per image), where any rounding fits the rows.

Scales and zero points stay as frozen. Rounding formulas: ``numerics._adaround``.

QDrop (Wei et al. 2022; ``AdaRound.drop``, off by default): each training step's input rows take
each element from the float model's input to the layer (``_float_rows``, the same positions)
with probability ``drop``, else the quantized model's, so the rounding is not fitted to one
pattern of upstream activation rounding; held-out rows and the keep test stay quantized.
Measured on PP-OCRv4 det (helper det20, 2026-12-02: the split-ranges row's PTQ on calibration
repeat 0, AdaRound defaults, sequential bias correction after, torch fake-quant SQNR; 16 held-out
dev images rendered at index 20000+ / the bench's 16 eval images / the 8 calibration images):
no AdaRound 18.25 / 18.92 / 17.75 dB, AdaRound 18.83 / 17.43 / 19.35, with ``drop=0.5``
19.27 / 17.70 / 19.62 (48 of 75 layers keep the learned rounding either way; 25 and 32 min at
load 10-19 on 2 shared cores). It beats plain AdaRound on all three sets, but the held-out
sets disagree on whether either beats round-to-nearest (+1.0 / -1.2 dB), within the +-1 dB
scatter of this model's 8-16 image scores.

Measured on PP-OCRv4 det (bench quick data, the split-ranges row + ``AdaRound()``, ONNX Runtime
fused, calibration repeats 0 / 1 / 2, 2026-12-02, scored on the 4 evaluation images the quick
bench had then; 16 since b44a929): 20.17 / 19.32 / 19.44 dB against 20.11 /
19.21 / 19.87 with round-to-nearest, about 3.5 min of AdaRound at load 9 on 2 cores. Before the
float weights were kept for ``float_mode``, 100 iterations on 1024 rows gave 13.99 dB on repeat
2; 19.28 after.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from ...numerics import (
    adaround_quantize,
    beta_schedule,
    dequantize,
    fake_quantize,
    floor_codes,
    hard_rounding,
    rectified_sigmoid,
    rectified_sigmoid_inverse,
    rounding_regularizer,
)
from ...recipe import AdaRound
from .._fakequant import WeightQuantizer
from .._model import QuantModel, float_mode, keep_float_weight
from .._nodes import weight_of
from .._ops import FOLDABLE_ACTIVATIONS
from .._progress import progress_bar, stage
from ._graph import conv_geometry, groups_of

aten = torch.ops.aten
_CONVS = {aten.conv1d.default: 1, aten.conv2d.default: 2}  # op -> spatial dims it unfolds


@dataclass
class LayerResult:
    """One layer's reconstruction error on its held-out rows (mean over rows of the squared
    error summed over output channels), round-to-nearest vs AdaRound's hard rounding, and which
    was kept; ``rows`` = cached rows (a fifth held out); ``flipped`` = weights whose code differs
    from round-to-nearest."""

    name: str
    rows: int
    error_nearest: float
    error_adaround: float
    kept: str  # "adaround" or "nearest"
    flipped: int
    seconds: float


@dataclass
class _Layer:
    node: torch.fx.Node
    quantizer: WeightQuantizer
    weight: torch.nn.Parameter
    bias: torch.Tensor | None
    clamp: tuple[float | None, float | None] | None


def weighted_layers(qmodel: QuantModel) -> list[_Layer]:
    """The layers AdaRound treats, in graph order (a weight quantizer that is a WeightQuantizer,
    enabled, not learnable; op conv1d, conv2d or linear)."""
    layers = []
    for node in qmodel.graph.nodes:
        if node.op != "call_function" or node.target not in (*_CONVS, aten.linear.default):
            continue
        wq = _module_arg(qmodel, node, 1)
        if not isinstance(wq, WeightQuantizer) or not wq.enabled or wq.learnable:
            continue
        bq = node.args[2] if len(node.args) > 2 else None
        bias = None
        if isinstance(bq, torch.fx.Node):
            bias_node = bq.args[0] if bq.op == "call_module" else bq
            if bias_node.op == "get_attr":
                bias = qmodel.get_parameter(bias_node.target).detach()
        layers.append(_Layer(node, wq, weight_of(qmodel, wq.weight_name), bias, _clamp(node)))
    return layers


def _module_arg(qmodel, node, i):
    arg = node.args[i] if len(node.args) > i else None
    if isinstance(arg, torch.fx.Node) and arg.op == "call_module":
        return qmodel.get_submodule(arg.target)
    return None


def _clamp(node):
    if len(node.users) != 1:
        return None
    (user,) = node.users
    if user.op == "call_function" and user.target in FOLDABLE_ACTIVATIONS and user.args[0] is node:
        return FOLDABLE_ACTIVATIONS[user.target](user)
    return None


# -- running the graph and tapping a layer's input / output ------------------------------------
class _Stop(Exception):
    pass


class _Tap(torch.fx.Interpreter):
    """Runs the graph; ``taps[node](input, output)`` is called as ``node`` runs; stops after
    ``stop`` (the rest of the graph is not needed)."""

    def __init__(self, gm, taps: dict, stop=None):
        super().__init__(gm)
        self.taps, self.stop = taps, stop

    def run_node(self, n):
        out = super().run_node(n)
        if n in self.taps:
            self.taps[n](self.env[n.args[0]], out)
            if n is self.stop:
                raise _Stop
        return out


def _flat_inputs(qmodel: QuantModel, args: tuple, kwargs: dict) -> list:
    """The graph's placeholder values for the call ``(args, kwargs)``, as the graph's own input
    processing flattens them (``Lockstep`` does the same): a dict batch of an imported ONNX model
    (keyword inputs named after the file's) included."""
    return list(qmodel.graph.process_inputs(*tree_flatten((args, kwargs))[0]))


def _run(qmodel, calls, taps, stop=None) -> None:
    with torch.no_grad():
        for args, kwargs in calls:
            try:
                _Tap(qmodel, taps, stop).run(*_flat_inputs(qmodel, args, kwargs))
            except _Stop:
                pass


# -- rows: im2col patches or tokens -------------------------------------------------------------
def _out_rows(node, out: torch.Tensor) -> torch.Tensor:
    """The layer output as (positions, channels)."""
    if node.target in _CONVS:
        return out.flatten(2).transpose(1, 2).reshape(-1, out.shape[1])
    return out.reshape(-1, out.shape[-1])


def _in_rows(node, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The layer input as (positions, features): the patches a conv multiplies, in the order of
    ``weight.reshape(out_channels, -1)`` within each group."""
    if node.target not in _CONVS:
        return x.reshape(-1, x.shape[-1])
    dims = _CONVS[node.target]
    stride, padding, dilation = conv_geometry(node, dims)
    kernel = tuple(weight.shape[2:])
    if dims == 1:  # conv1d as a conv2d of height 1
        x = x.unsqueeze(2)
        kernel, stride, padding, dilation = (
            (1, *kernel),
            (1, *stride),
            (0, *padding),
            (1, *dilation),
        )
    cols = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])


def _layer_output(rows, weight, bias, groups, clamp):
    """``rows @ weight.T + bias`` per group, then the following clamp: the layer at those rows."""
    w = weight.reshape(groups, weight.shape[0] // groups, -1)
    out = torch.einsum("rgk,gok->rgo", rows.reshape(rows.shape[0], groups, -1), w)
    out = out.reshape(rows.shape[0], -1)
    if bias is not None:
        out = out + bias
    if clamp is not None:
        out = out.clamp(clamp[0], clamp[1])
    return out


# -- the whole pass -----------------------------------------------------------------------------
def adaround(
    qmodel: QuantModel,
    calls: list[tuple[tuple, dict]],
    config: AdaRound | None = None,
    progress: bool | None = None,
    seed: int = 0,
) -> list[LayerResult]:
    """AdaRound every weighted layer of the frozen ``qmodel`` on ``calls`` (``(args, kwargs)``
    calibration batches); see the module docstring. Weights change in place."""
    config = config or AdaRound()
    if not calls:
        raise ValueError("adaround needs calibration batches; got none")
    calls = calls[: config.calib_batches]
    layers = weighted_layers(qmodel)
    was_training = qmodel.training
    qmodel.eval()
    gen = torch.Generator().manual_seed(seed)
    per_call = max(1, math.ceil(config.rows / len(calls)))
    picks: dict[tuple[int, int], torch.Tensor] = {}
    targets: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers))}
    try:
        with stage(f"adaround: float targets of {len(layers)} layers", progress):
            for c, call in enumerate(calls):
                taps = {}
                for i, layer in enumerate(layers):

                    def tap(x, out, i=i, c=c, layer=layer):
                        rows = _out_rows(layer.node, out)
                        pick = torch.randperm(rows.shape[0], generator=gen)[:per_call]
                        picks[(i, c)] = pick
                        targets[i].append(_clamped(rows[pick], layer.clamp))

                    taps[layer.node] = tap
                with float_mode(qmodel):
                    _run(qmodel, [call], taps)
        results = []
        for i, layer in enumerate(layers):
            rows = []
            for c, call in enumerate(calls):

                def tap(x, out, i=i, c=c, layer=layer, rows=rows):
                    rows.append(_in_rows(layer.node, x, layer.weight)[picks[(i, c)]])

                _run(qmodel, [call], {layer.node: tap}, stop=layer.node)
            floats = None
            if config.drop > 0:  # QDrop: the float model's rows at the same positions
                floats = _float_rows(
                    qmodel, calls, layer, [picks[(i, c)] for c in range(len(calls))]
                )
            name = f"{layer.quantizer.name} ({i + 1}/{len(layers)})"
            target = torch.cat(targets.pop(i))
            results.append(
                _round_layer(layer, torch.cat(rows), target, config, gen, progress, name, floats)
            )
    finally:
        qmodel.train(was_training)
    return results


def _float_rows(qmodel, calls, layer, picks) -> torch.Tensor:
    """The layer's input rows at ``picks`` (one per call) in the float model (QDrop's float
    operand)."""
    rows: list[torch.Tensor] = []
    with float_mode(qmodel):
        for call, pick in zip(calls, picks, strict=True):

            def tap(x, out, pick=pick):
                rows.append(_in_rows(layer.node, x, layer.weight)[pick])

            _run(qmodel, [call], {layer.node: tap}, stop=layer.node)
    return torch.cat(rows)


def _clamped(rows, clamp):
    return rows if clamp is None else rows.clamp(clamp[0], clamp[1])


def _round_layer(layer, rows, target, config, gen, progress, name, floats=None) -> LayerResult:
    start = time.perf_counter()
    q = layer.quantizer
    w = layer.weight.detach()
    scale, zero_point, axis = q.scale.to(w.dtype), q.zero_point, q.axis
    groups = groups_of(layer.node)
    rows, target = rows.to(w.dtype), target.to(w.dtype)
    floats = floats.to(w.dtype) if floats is not None else None

    # a fifth of the rows is held out: the rounding is learned on the rest and kept only if it
    # reconstructs the held-out rows better than round-to-nearest (few rows can be overfitted)
    order = torch.randperm(rows.shape[0], generator=gen)
    held, rows, target = order[: max(1, rows.shape[0] // 5)], rows, target
    train = order[held.shape[0] :] if rows.shape[0] > 1 else order

    def error(weight, which):
        with torch.no_grad():
            out = _layer_output(rows[which], weight, layer.bias, groups, layer.clamp)
            return float(((out - target[which]) ** 2).sum(1).mean())

    nearest = fake_quantize(w, scale, zero_point, q.qmin, q.qmax, axis)
    if train.shape[0] < w[0].numel():
        # fewer training rows than weights per output channel (a squeeze-excite conv reads one
        # pooled position per image: 7 rows on PP-OCRv4 det): any rounding fits them, and a
        # held-out fifth of a few rows cannot tell (det, 100 iterations: 1551 weights of one
        # such layer flipped on 6 rows, kept on 1 held-out row). Round-to-nearest, not learned.
        error_nearest = error(nearest, held)
        return _keep(layer, w, nearest, nearest, error_nearest, error_nearest, rows, start)
    down, frac = floor_codes(w, scale, axis)

    def weight_of(up):
        codes = adaround_quantize(down, up, zero_point, q.qmin, q.qmax, axis)
        return dequantize(codes, scale, zero_point, axis).to(w.dtype)

    v = rectified_sigmoid_inverse(frac).detach().requires_grad_(True)
    error_nearest = error(nearest, held)
    norm = max(error(nearest, train), torch.finfo(w.dtype).tiny)
    optimizer = torch.optim.Adam([v], lr=config.lr)
    batch = min(config.batch_rows, train.shape[0])
    warm = math.floor(config.warmup * config.iterations)
    steps = progress_bar(range(config.iterations), progress, f"adaround {name}", config.iterations)
    for step in steps:
        pick = train[torch.randint(train.shape[0], (batch,), generator=gen)]
        h = rectified_sigmoid(v)
        x = rows[pick]
        if floats is not None:  # QDrop: each element float with probability ``drop``
            keep = torch.rand(x.shape, generator=gen, dtype=x.dtype) >= config.drop
            x = torch.where(keep, x, floats[pick])
        out = _layer_output(x, weight_of(h), layer.bias, groups, layer.clamp)
        loss = ((out - target[pick]) ** 2).sum(1).mean() / norm
        if step >= warm:
            beta = beta_schedule(
                step, config.iterations, config.beta_start, config.beta_end, config.warmup
            )
            loss = loss + config.reg_weight * rounding_regularizer(h, beta)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    hard = weight_of(hard_rounding(v.detach(), frac).to(w.dtype))
    return _keep(layer, w, hard, nearest, error(hard, held), error_nearest, rows, start)


def _keep(layer, w, hard, nearest, error_hard, error_nearest, rows, start) -> LayerResult:
    """Write ``hard`` into the layer's weight if it reconstructs the held-out rows at least as
    well as round-to-nearest, else ``nearest``; the float weight stays ``float_mode``'s."""
    kept = "adaround" if error_hard <= error_nearest and hard is not nearest else "nearest"
    chosen = hard if kept == "adaround" else nearest
    float_weight = w.clone()  # ``w`` shares the parameter's storage
    with torch.no_grad():
        layer.weight.copy_(chosen)
    keep_float_weight(layer.quantizer, layer.weight, float_weight)
    return LayerResult(
        name=layer.quantizer.name,
        rows=int(rows.shape[0]),
        error_nearest=error_nearest,
        error_adaround=error_hard,
        kept=kept,
        flipped=int((chosen != nearest).sum()),
        seconds=time.perf_counter() - start,
    )


# -- collecting the calibration calls -----------------------------------------------------------
def keep_calls(calls: Iterator, kept: list, limit: int) -> Iterator:
    """``calls`` (``(index, args, kwargs)``) passed through; the first ``limit`` kept as
    ``(args, kwargs)`` in ``kept`` for AdaRound."""
    for item in calls:
        if len(kept) < limit:
            kept.append((item[1], item[2]))
        yield item


def record_calls(forward_loop: Callable, qmodel: QuantModel, limit: int) -> list:
    """Run ``forward_loop(qmodel)`` once more and keep its first ``limit`` calls' inputs."""
    kept: list = []

    def hook(module, args, kwargs):
        if len(kept) < limit:
            kept.append((args, kwargs))

    handle = qmodel.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            forward_loop(qmodel)
    finally:
        handle.remove()
    return kept
