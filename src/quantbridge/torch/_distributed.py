"""Calibration and QAT across processes (``torch.distributed``: gloo on CPU, NCCL on GPU).

Every rank calibrates on its own shard of the data; before the scales are frozen, the statistics
of every activation quantizer are combined across ranks, so each rank freezes the same scales and
zero points - the ones a single process would compute over the union of the shards.

``sync_observers(qmodel)`` does it; ``quantize`` and ``prepare_qat`` call it just before
``freeze`` whenever a process group is initialized with more than one rank (and not inside
``local_statistics()``). Quantizers are visited in placement order on every rank, and ranks
whose observer saw no data take part with an empty one, so no rank waits for a peer that skips.

How each observer's statistics combine (a table keyed by observer type, ``_EXACT_REDUCTIONS``):

* ``minmax`` (per tensor or per channel): ``all_reduce(MAX)`` of ``[-min, max]``. Exact.
* ``percentile``, ``entropy``, ``mse`` (the power-of-two histogram of ``calibrate._histogram``):
  ``MAX`` of ``[half_range, -min, max]``; ``histogram.grow_to(half_range)`` on every rank; ``SUM``
  of the counts. Exact: the histogram equals the one of a single process over all the data.
* every other observer (``moving_average_minmax``, observers registered by users): all-gather of
  the ``state_dict()``s, then on every rank ``load_state_dict(rank 0)`` and ``merge`` of ranks
  ``1 .. W-1`` in rank order, so every rank computes the same (for the moving average, the
  documented batch-weighted approximation).

Before any of that, one all-gather of ``[number of observers, fingerprint of names and types]``
and one of ``[values_seen, size]`` per observer let every rank check the layout; a mismatch
raises ``ValueError`` on every rank (naming the first differing quantizer) instead of hanging.

QAT. Under ``DistributedDataParallel`` (DDP) the moving-average ranges of ``prepare_qat``
(``learn_scales=False``) follow the min and max over every rank's batch: ``Quantizer._track``
calls ``ddp_batch_range``, one ``all_reduce(MAX)`` of two numbers per quantizer and step over the
DDP's process group, so the scales stay identical on every rank whether or not DDP broadcasts
buffers. Outside a DDP forward, tracking uses the local batch and runs no collective. LSQ scales
(``learn_scales=True``) are parameters: DDP averages their gradients like any other.

``assert_quantizers_synchronized(qmodel)`` all-gathers every quantizer's scale and zero point
and raises ``AssertionError`` naming the first that differs between ranks.

Every rank must reach every collective: if one rank fails during calibration, the others wait
until the process group's timeout. Where only some ranks quantize (say rank 0, after training),
wrap the call in ``local_statistics()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import zlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..calibrate import (
    EntropyObserver,
    MinMaxObserver,
    MSEObserver,
    Observer,
    PercentileObserver,
)
from ._fakequant import Quantizer
from ._model import QuantModel

_EXTREMA, _HISTOGRAM, _GATHER = 0, 1, 2

# Observer types whose statistics all-reduce exactly as tensors. Exact types, not subclasses: a
# subclass may keep more state. Any type not listed takes the gather-and-merge path.
_EXACT_REDUCTIONS: dict[type[Observer], int] = {
    MinMaxObserver: _EXTREMA,
    PercentileObserver: _HISTOGRAM,
    EntropyObserver: _HISTOGRAM,
    MSEObserver: _HISTOGRAM,
}

_LOCAL = contextvars.ContextVar("quantbridge_local_statistics", default=False)


@contextlib.contextmanager
def local_statistics() -> Iterator[None]:
    """Inside: calibration and QAT range tracking use this process's data only, no collectives.

    For a process group where only some ranks quantize (``if rank == 0: qb.quantize(...)``).
    """
    token = _LOCAL.set(True)
    try:
        yield
    finally:
        _LOCAL.reset(token)


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """True when statistics are to be combined: a process group of more than one rank is
    initialized and we are not inside ``local_statistics()``."""
    return (
        not _LOCAL.get()
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size(group) > 1
    )


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where collective tensors live: the current GPU for NCCL, the CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``(world, *t.shape)``: every rank's ``t`` (same shape and dtype on every rank)."""
    t = t.to(_device(group))
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return torch.stack(out).cpu()


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None):
    t = t.to(_device(group))
    dist.all_reduce(t, op=op, group=group)
    return t.cpu()


# ---- layout agreement ---------------------------------------------------------------------------


def _check_same_layout(descriptors: list[str], group: dist.ProcessGroup | None) -> None:
    """Raise ``ValueError`` on every rank unless every rank holds the same list of descriptors.

    One all-gather of ``[len, crc32]``; only on a mismatch the lists themselves are gathered (as
    objects) to name the first difference.
    """
    fingerprint = zlib.crc32("\n".join(descriptors).encode())
    mine = torch.tensor([len(descriptors), fingerprint], dtype=torch.int64)
    every = _all_gather(mine, group)
    if bool((every == every[0]).all()):
        return
    lists: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(lists, descriptors, group=group)
    for rank, other in enumerate(lists):
        for i in range(max(len(other), len(lists[0]))):
            a = lists[0][i] if i < len(lists[0]) else "<none>"
            b = other[i] if i < len(other) else "<none>"
            if a != b:
                raise ValueError(
                    f"ranks disagree on the quantizers to synchronize: #{i} is {a!r} on rank 0 "
                    f"but {b!r} on rank {rank}; every rank must quantize the same model with "
                    "the same recipe"
                )
    raise ValueError("ranks disagree on the quantizers to synchronize (fingerprint mismatch)")


# ---- observer statistics ------------------------------------------------------------------------


def sync_observer_states(
    observers: Sequence[Observer],
    group: dist.ProcessGroup | None = None,
    names: Sequence[str] | None = None,
) -> None:
    """Replace each observer's statistics, on every rank, by those of all ranks combined.

    ``observers[i]`` must be an observer of the same method and options on every rank (empty
    where a rank saw no data). No-op unless ``is_distributed(group)``. See the module docstring.
    """
    if not is_distributed(group):
        return
    names = list(names) if names is not None else [f"observer #{i}" for i in range(len(observers))]
    kinds = [_EXACT_REDUCTIONS.get(type(obs), _GATHER) for obs in observers]
    _check_same_layout(
        [
            f"{n}|{type(o).__name__}|{o.granularity!r}"
            for n, o in zip(names, observers, strict=True)
        ],
        group,
    )
    if not observers:
        return
    local = [_meta(obs, kind) for obs, kind in zip(observers, kinds, strict=True)]
    meta = _all_gather(torch.tensor(local, dtype=torch.int64), group)
    sizes = _agreed_sizes(meta, kinds, names)
    values_seen = meta[:, :, 0].sum(dim=0).tolist()

    tensor_path = [i for i, k in enumerate(kinds) if k != _GATHER and values_seen[i] > 0]
    if tensor_path:
        _reduce_tensors(observers, kinds, tensor_path, sizes, values_seen, group)
    gather_path = [i for i, k in enumerate(kinds) if k == _GATHER and values_seen[i] > 0]
    if gather_path:
        _gather_and_merge([observers[i] for i in gather_path], group)


def _meta(obs: Observer, kind: int) -> list[int]:
    """``[values_seen, size]``: channels held (0 when empty) or histogram bins."""
    if kind == _EXTREMA:
        return [obs.values_seen, int(np.size(obs.state_dict()["min"])) if obs.values_seen else 0]
    if kind == _HISTOGRAM:
        return [obs.values_seen, obs.histogram.num_bins]
    return [obs.values_seen, 0]


def _agreed_sizes(meta: torch.Tensor, kinds: list[int], names: Sequence[str]) -> list[int]:
    """Per observer, the size every rank holding data agrees on (``ValueError`` otherwise)."""
    sizes = []
    for i, kind in enumerate(kinds):
        seen, size = meta[:, i, 0], meta[:, i, 1]
        held = size[seen > 0] if kind == _EXTREMA else size
        distinct = sorted(set(held.tolist()))
        if len(distinct) > 1:
            what = "channel counts" if kind == _EXTREMA else "histogram bin counts"
            raise ValueError(
                f"{names[i]}: ranks hold different {what} {size.tolist()} (rank order); "
                "every rank must calibrate the same model with the same recipe"
            )
        sizes.append(distinct[0] if distinct else 0)
    return sizes


def _reduce_tensors(observers, kinds, indices, sizes, values_seen, group) -> None:
    """The exact paths: one MAX over extrema and histogram ranges, one SUM over counts."""
    pieces = []
    for i in indices:
        obs = observers[i]
        if kinds[i] == _EXTREMA:
            if obs.values_seen:
                lo, hi = (np.asarray(v, dtype=np.float64).reshape(-1) for v in obs.range())
            else:
                lo, hi = np.full(sizes[i], np.inf), np.full(sizes[i], -np.inf)
            pieces.append(np.concatenate([-lo, hi]))
        else:
            h = obs.histogram
            pieces.append(np.array([h.half_range, -h.min, h.max]))
    maxima = _all_reduce(torch.from_numpy(np.concatenate(pieces)), dist.ReduceOp.MAX, group)
    maxima = maxima.numpy()

    states, counts, offset = {}, [], 0
    for i in indices:
        obs, state = observers[i], observers[i].state_dict()
        state["values_seen"] = int(values_seen[i])
        if kinds[i] == _EXTREMA:
            n = sizes[i]
            shape = np.shape(state["min"]) if obs.values_seen else _extrema_shape(obs, n)
            state["min"] = (-maxima[offset : offset + n]).reshape(shape)
            state["max"] = maxima[offset + n : offset + 2 * n].reshape(shape)
            offset += 2 * n
        else:
            half_range, neg_min, max_ = maxima[offset : offset + 3]
            obs.histogram.grow_to(float(half_range))
            state.update(half_range=float(half_range), min=float(-neg_min), max=float(max_))
            counts.append(obs.histogram.counts)
            offset += 3
        states[i] = state
    if counts:
        total = _all_reduce(torch.from_numpy(np.concatenate(counts)), dist.ReduceOp.SUM, group)
        total, start = total.numpy(), 0
        for i in indices:
            if kinds[i] == _HISTOGRAM:
                n = observers[i].histogram.num_bins
                states[i]["counts"] = total[start : start + n].copy()
                start += n
    for i in indices:
        observers[i].load_state_dict(states[i])


def _extrema_shape(obs: Observer, size: int) -> tuple[int, ...]:
    return () if obs.state_dict()["granularity"] == "per_tensor" else (size,)


def _gather_and_merge(observers: list[Observer], group) -> None:
    """All-gather the state dicts; every rank loads rank 0's and merges the others in order."""
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, [obs.state_dict() for obs in observers], group=group)
    for i, obs in enumerate(observers):
        obs.load_state_dict(every[0][i])
        for states in every[1:]:
            obs.merge(states[i])


# ---- quantized models ---------------------------------------------------------------------------


def _activation_quantizers(qmodel: nn.Module) -> list[tuple[str, Quantizer]]:
    """Observing activation quantizers in placement order (the same order on every rank)."""
    return [
        (name, q)
        for name, q in _quant_model(qmodel).quantizers().items()
        if isinstance(q, Quantizer) and q.kind == "activation" and q.observing
    ]


def _quant_model(model: nn.Module) -> QuantModel:
    inner = getattr(model, "module", model)  # DistributedDataParallel(qmodel)
    if not isinstance(inner, QuantModel):
        raise TypeError(
            f"expected a QuantModel (from quantize or prepare_qat) or DDP around one, got "
            f"{type(model).__name__}"
        )
    return inner


def sync_observers(qmodel: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Combine every observing activation quantizer's statistics across the ranks of ``group``.

    Call it once per calibration, on every rank, after the calibration batches and before
    ``freeze`` (``quantize`` and ``prepare_qat`` do). A quantizer that saw no data on any rank
    stays without an observer, so ``freeze`` reports it by name on every rank. No-op unless a
    process group of more than one rank is initialized (see ``local_statistics``).
    """
    if not is_distributed(group):
        return
    points = _activation_quantizers(qmodel)
    observers = [q.observer if q.observer is not None else q._new_observer() for _, q in points]
    sync_observer_states(observers, group, names=[name for name, _ in points])
    for (_, q), obs in zip(points, observers, strict=True):
        q.observer = obs if obs.values_seen > 0 else None


def ddp_batch_range(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inside a DDP forward: ``(min, max)`` of the batch over every rank of the DDP's group.

    Called by ``Quantizer._track``; outside DDP (or inside ``local_statistics()``) ``(lo, hi)``
    unchanged, without a collective.
    """
    ddp = getattr(nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None or _LOCAL.get():
        return lo, hi
    group = ddp.process_group
    if dist.get_world_size(group) == 1:
        return lo, hi
    both = _all_reduce(torch.stack([-lo, hi]).double(), dist.ReduceOp.MAX, group).to(lo.device)
    return -both[0], both[1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The exact bit patterns of a scale or zero point (float32 or int32) as int64."""
    t = t.detach().cpu().reshape(-1)
    if t.is_floating_point():
        return t.float().view(torch.int32).long()
    return t.long()


def assert_quantizers_synchronized(
    qmodel: nn.Module, group: dist.ProcessGroup | None = None
) -> None:
    """``AssertionError`` naming the first quantizer whose scale (the one in use, learned or
    not) or zero point is not bitwise equal on every rank of ``group``. No-op unless
    ``is_distributed(group)``.

    Run it on every rank (it all-gathers); ``qmodel`` may be wrapped in DDP.
    """
    if not is_distributed(group):
        return
    quantizers = [
        (name, q)
        for name, q in _quant_model(qmodel).quantizers().items()
        if isinstance(q, Quantizer)
    ]
    _check_same_layout([name for name, _ in quantizers], group)
    values = [(_bits(q.current_scale()), _bits(q.zero_point)) for _, q in quantizers]
    lengths = torch.tensor([len(s) + len(z) for s, z in values], dtype=torch.int64)
    every_length = _all_gather(lengths, group)
    for rank, other in enumerate(every_length.tolist()):
        for (name, _), a, b in zip(quantizers, every_length[0].tolist(), other, strict=True):
            if a != b:
                raise AssertionError(
                    f"quantizer {name!r} holds {a} scale and zero point values on rank 0 but "
                    f"{b} on rank {rank}"
                )
    if not values:
        return
    every = _all_gather(torch.cat([torch.cat(v) for v in values]), group)
    start = 0
    for (name, q), (scale, zero_point) in zip(quantizers, values, strict=True):
        stop = start + len(scale) + len(zero_point)
        differs = (every[:, start:stop] != every[0, start:stop]).any(dim=1)
        if bool(differs.any()):
            rank = int(differs.nonzero()[0, 0])
            raise AssertionError(
                f"quantizer {name!r} differs between rank 0 and rank {rank}: "
                f"{_describe(every[0, start:stop], scale, q)} on rank 0, "
                f"{_describe(every[rank, start:stop], scale, q)} on rank {rank}"
            )
        start = stop


def _describe(bits: torch.Tensor, scale: torch.Tensor, q: Quantizer) -> str:
    n = len(scale)
    s = bits[:n].int().view(torch.float32)
    z = bits[n:].int()
    if q.zero_point.is_floating_point():
        z = z.view(torch.float32)
    return f"scale {s.tolist()}, zero_point {z.tolist()}"


__all__ = [
    "assert_quantizers_synchronized",
    "ddp_batch_range",
    "is_distributed",
    "local_statistics",
    "sync_observer_states",
    "sync_observers",
]
