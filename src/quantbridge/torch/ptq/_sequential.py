"""The sequential empirical bias correction (``Recipe.bias_correction="sequential"``, the
default preset's; the method and its options: ``_bias_correction``'s docstring) and the
per-channel output means both corrections take.

Memory: one float pass a batch at a time (for the float means; past ``SEQUENTIAL_MEMORY``
bytes of live values, measured there, only the first batches that fit are used, and the
progress line says so), then one quantized pass over the kept batches (``Lockstep.sweep``):
the graph is cut at the corrected layers; between two of them the nodes run a batch at a time,
so what is held is each batch's values that a later node still reads at the cut (ResNet-18-style:
a stage-1 block's input and its first activation) plus one batch's values in flight, not every
batch's values at every node (the stem conv's output and its activation's for all images). The
values held from one stretch to the next are quantizer outputs, kept as their integer codes
(``_codes``: 1 byte an element, not 4; the round trip checked bit-exact), and the heap's free
pages go back to the system after a stretch that freed large values (``torch._heap``). A
corrected layer's output is summed batch by batch and not kept; the layer runs again after its
bias moved. Weight and bias quantizers run once, their values shared by the batches, just
before their layer. Measured (bench figure 3, ResNet-18-style, peak over the setup peak): 16
images 277 -> 224-237 MiB, 64 images 578 -> 235 (ONNX Runtime: 483, 484); the walk is no longer
the peak.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from ...numerics import dequantize, quantize, shrink_bias_shift
from .._fakequant import QState, Quantizer
from .._model import float_mode
from .._progress import progress_bar, stage
from ._graph import CONV_OPS, Lockstep, attr_node, get_tensor


def _channel_means(
    node: torch.fx.Node, y: torch.Tensor, sums: dict, counts: dict, keep: torch.Tensor | None = None
) -> None:
    """Add ``node``'s output ``y`` to its per-channel sums and counts; with ``keep`` (a bool
    mask over a linear output's leading dimensions) only the positions it marks."""
    if keep is not None and node.target not in CONV_OPS and y.shape[:-1] == keep.shape:
        y = y[keep]
    axis = 1 if node.target in CONV_OPS else y.ndim - 1
    # one float64-accumulating reduction over every other dim: no float64 copy, no transpose
    # (a 1-D output is its own sum: ``sum(dim=())`` would reduce every dim)
    dims = tuple(d for d in range(y.ndim) if d != axis)
    total = y.sum(dim=dims, dtype=torch.float64) if dims else y.double()
    sums[node] = sums.get(node, 0) + total
    counts[node] = counts.get(node, 0) + y.numel() // y.shape[axis]


def _sample_means(
    node: torch.fx.Node, y: torch.Tensor, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-sample channel sums (samples, channels), positions per sample (samples,)), float64,
    of ``node``'s output ``y``; a sample is an index of dim 0 (1-D: one sample), ``keep`` as in
    ``_channel_means``."""
    if y.ndim < 2:
        return y.double()[None], torch.ones(1, dtype=torch.float64)
    conv = node.target in CONV_OPS
    if keep is not None and not conv and y.shape[:-1] == keep.shape:
        k = keep.reshape(keep.shape[0], -1, 1)
        rows = y.reshape(y.shape[0], -1, y.shape[-1])
        return torch.where(k, rows, 0).sum(1, dtype=torch.float64), k.sum((1, 2)).double()
    axis = 1 if conv else y.ndim - 1
    dims = tuple(d for d in range(1, y.ndim) if d != axis)
    sums = y.sum(dim=dims, dtype=torch.float64) if dims else y.double()
    per = y.numel() // (y.shape[0] * y.shape[axis])
    return sums, torch.full((y.shape[0],), float(per), dtype=torch.float64)


# at most this many bytes of live values (one per live edge per batch, measured on the float
# pass) in the sequential pass: past it, only the first calibration batches are used
SEQUENTIAL_MEMORY = 2 << 30


def position_masks(batches: list, name: str) -> list:
    """Per ``(args, kwargs)`` batch, its keyword input ``name`` as a bool mask (nonzero: a real
    position), or None throughout when ``name`` is empty."""
    if not name:
        return [None] * len(batches)
    masks = []
    for i, (_, kwargs) in enumerate(batches):
        if name not in kwargs:
            raise ValueError(
                f"Recipe.bias_correction_mask={name!r}: calibration batch {i} has no keyword input"
                f" of that name (its keywords: {sorted(kwargs)}); pass the batches as dicts with"
                f" the mask under {name!r}, or set bias_correction_mask='' (every position)"
            )
        masks.append(torch.as_tensor(kwargs[name]) != 0)
    return masks


def _float_means(qmodel, layers, batches, progress, masks, samples=None) -> tuple[dict, list]:
    """One float pass, a batch at a time: (per layer its float mean output over the positions
    ``masks`` keep, the batches kept), the batches kept being the first ones whose live values
    fit ``SEQUENTIAL_MEMORY`` together (at least one). ``samples`` (a dict): filled with, per
    layer, a list of ``_sample_means`` per kept batch."""
    sums: dict = {}
    counts: dict = {}
    kept: list = []
    held = 0
    watched = set(layers)

    def after(node, values, step, keep, batch_sums, batch_counts, batch_samples):
        if node in watched:
            _channel_means(node, values[0], batch_sums, batch_counts, keep)
            if samples is not None:
                batch_samples[node] = _sample_means(node, values[0], keep)

    with float_mode(qmodel):
        for batch, keep in zip(
            progress_bar(batches, progress, "bias correction: float pass"), masks, strict=False
        ):
            batch_sums: dict = {}
            batch_counts: dict = {}
            batch_samples: dict = {}
            sinks = {"batch_sums": batch_sums, "batch_counts": batch_counts}
            peak = Lockstep(qmodel, [batch]).run(
                partial(after, keep=keep, batch_samples=batch_samples, **sinks)
            )
            if kept and held + peak > SEQUENTIAL_MEMORY:
                break
            held += peak
            kept.append(batch)
            for node, total in batch_sums.items():  # same float64 sums, same order, as one dict
                sums[node] = sums.get(node, 0) + total
                counts[node] = counts.get(node, 0) + batch_counts[node]
            for node, found in batch_samples.items():
                samples.setdefault(node, []).append(found)
    return {node: sums[node] / counts[node] for node in sums}, kept


def _bias_chain(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes from the bias parameter to ``node``'s bias argument (its quantizer), in order."""
    chain = [node.args[2]]
    while chain[-1] is not attr_node(node.args[2]):
        chain.append(chain[-1].args[0])
    return chain[::-1]


def _correct_sequentially(qmodel, layers, batches, progress, masks, shrink=False) -> None:
    """Per layer in graph order, applied to its bias before the graph goes on: mean float output
    minus mean quantized output with the corrections before it. One float pass, then one quantized
    pass over every kept batch (``Lockstep.sweep``): at a corrected layer, its output on each
    batch in turn is summed (not kept), its shift goes into the float bias, and the layer runs
    again with the bias through its int32 quantizer. ``masks``: per batch, the positions the
    means run over (``position_masks``). ``shrink``: the shift is ``numerics.shrink_bias_shift``
    of the per-sample errors instead (``_bias_correction``'s docstring)."""
    samples: dict | None = {} if shrink else None
    float_means, kept = _float_means(qmodel, layers, batches, progress, masks, samples)
    sums: dict = {}
    counts: dict = {}
    errors: list = []  # shrink: per kept batch, (per-sample errors, positions per sample)

    def measure(node, i, value):
        # batch after batch, as the float pass sums
        if samples is None:
            _channel_means(node, value, sums, counts, masks[i])
            return
        f_sums, f_counts = samples[node][i]
        q_sums, _ = _sample_means(node, value, masks[i])  # the float pass's shapes and counts
        n = f_counts.clamp(min=1)[:, None]
        errors.append((f_sums / n - q_sums / n, f_counts))

    def correct(node):
        if samples is None:
            shift = float_means[node] - sums.pop(node) / counts.pop(node)
        else:
            found = torch.cat([e for e, _ in errors]), torch.cat([c for _, c in errors])
            shift = torch.from_numpy(shrink_bias_shift(*found))
            errors.clear()
        _add_to_bias(qmodel, node, shift)
        return _bias_chain(node)

    what = f"bias correction: sequential, {len(layers)} layers on {len(kept)} batches"
    if len(kept) < len(batches):
        what += f" of {len(batches)}: the first that fit SEQUENTIAL_MEMORY"
    with stage(what, progress):
        Lockstep(qmodel, kept).sweep(set(float_means), measure, correct, partial(_codes, qmodel))


def _codes(qmodel, node: torch.fx.Node, value) -> Callable[[], torch.Tensor] | None:
    """``value``, the output of ``node``, held as its integer codes when ``node`` is a fixed-grid
    quantizer (1 byte an element for 8 bits, not 4): how to get it back (``numerics.dequantize``,
    the last two operations of ``fake_quantize``), or None when it is not such an output or the
    round trip is not bit-exact (checked here: values and strides)."""
    if node.op != "call_module" or not isinstance(value, torch.Tensor):
        return None
    quantizer = qmodel.get_submodule(node.target)
    if not (
        isinstance(quantizer, Quantizer)
        and quantizer.enabled
        and quantizer._state is QState.FROZEN
        and not quantizer._exporting()
        and value.dtype == torch.float32
    ):
        return None
    scale, zero_point, axis = quantizer.scale, quantizer.zero_point, quantizer.axis
    qmin, qmax = quantizer.qmin, quantizer.qmax
    dtype = next(
        t for t in _CODE_TYPES if torch.iinfo(t).min <= qmin and qmax <= torch.iinfo(t).max
    )
    codes = quantize(value, scale, zero_point, qmin, qmax, axis).to(dtype)

    def rebuild() -> torch.Tensor:
        return dequantize(codes, scale, zero_point, axis)

    back = rebuild()
    return rebuild if back.stride() == value.stride() and torch.equal(back, value) else None


_CODE_TYPES = (torch.uint8, torch.int8, torch.int16, torch.int32)


def _add_to_bias(qmodel, node: torch.fx.Node, shift: torch.Tensor) -> None:
    with torch.no_grad():
        bias = get_tensor(qmodel, attr_node(node.args[2]))
        bias += shift.to(bias.dtype)
