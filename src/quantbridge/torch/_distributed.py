"""Calibration and QAT across processes (``torch.distributed``: gloo on CPU, NCCL on GPU).

Every rank calibrates on its own shard of the data; before the scales are frozen, the statistics
of every activation quantizer are combined across ranks, so each rank freezes the same scales and
zero points - the ones a single process would compute over the union of the shards.

``sync_observers(qmodel)`` does it; ``quantize`` and ``prepare_qat`` call it just before
``freeze`` whenever a process group is initialized with more than one rank (and not inside
``local_statistics()``). Quantizers are visited in placement order on every rank, and ranks
whose observer saw no data take part with an empty one, so no rank waits for a peer that skips.

How statistics combine is each observer's own business (``calibrate``): this module only moves
tensors and never reads an observer's internals.

* observers with ``tensor_merge`` (``minmax``; ``percentile``, ``entropy``, ``mse`` on the
  power-of-two histogram): one ``all_reduce(MAX)`` of everyone's ``merge_maxima`` (ranges), each
  observer's ``load_maxima`` (a histogram grows to the common range), one ``all_reduce(SUM)`` of
  ``merge_sums`` (counts), ``load_sums``. Exact: the statistics equal those of a single process
  over all the data.
* every other observer (``moving_average_minmax``, observers registered by users): all-gather of
  the ``state_dict()``s, then on every rank ``load_state_dict(rank 0)`` and ``merge`` of ranks
  ``1 .. W-1`` in rank order, so every rank computes the same (for the moving average, the
  documented batch-weighted approximation).

Before any of that, one all-gather of ``[number of observers, fingerprint of names and types]``
and one of ``[values_seen, merge_size]`` per observer let every rank check the layout; a mismatch
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

import zlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..calibrate import Observer
from ._collective import all_gather as _all_gather
from ._collective import all_reduce as _all_reduce
from ._collective import ddp_batch_range, is_distributed, local_statistics
from ._fakequant import QState, Quantizer
from ._model import QuantModel

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
    _check_same_layout(
        [
            f"{n}|{type(o).__name__}|{o.granularity!r}"
            for n, o in zip(names, observers, strict=True)
        ],
        group,
    )
    if not observers:
        return
    local = [[o.values_seen, o.merge_size() if o.tensor_merge else 0] for o in observers]
    meta = _all_gather(torch.tensor(local, dtype=torch.int64), group)
    values_seen = meta[:, :, 0].sum(dim=0).tolist()
    sizes = _agreed_sizes(meta, observers, names)
    live = [i for i, o in enumerate(observers) if values_seen[i] > 0]
    by_tensors = [i for i in live if observers[i].tensor_merge]
    if by_tensors:
        _reduce_tensors([observers[i] for i in by_tensors], [sizes[i] for i in by_tensors],
                        [values_seen[i] for i in by_tensors], group)  # fmt: skip
    by_states = [observers[i] for i in live if not observers[i].tensor_merge]
    if by_states:
        _gather_and_merge(by_states, group)


def _agreed_sizes(meta: torch.Tensor, observers, names: Sequence[str]) -> list[int]:
    """Per observer, the merge size every rank holding one agrees on (``ValueError`` otherwise;
    0 = no data, any layout)."""
    sizes = []
    for i, obs in enumerate(observers):
        size = meta[:, i, 1]
        distinct = sorted(set(size[size > 0].tolist()))
        if len(distinct) > 1:
            raise ValueError(
                f"{names[i]}: ranks hold different {obs.merge_size_name} {size.tolist()} (rank "
                "order); every rank must calibrate the same model with the same recipe"
            )
        sizes.append(distinct[0] if distinct else 0)
    return sizes


def _reduce_tensors(observers: list[Observer], sizes: list[int], values_seen: list[int], group):
    """The observers' own merge tensors: one MAX all-reduce, then one SUM all-reduce."""
    pieces = [obs.merge_maxima(n) for obs, n in zip(observers, sizes, strict=True)]
    maxima = _all_reduce(torch.from_numpy(np.concatenate(pieces)), dist.ReduceOp.MAX, group)
    for obs, n, piece in zip(observers, sizes, _split(maxima.numpy(), pieces), strict=True):
        obs.load_maxima(piece, n)
    pieces = [obs.merge_sums() for obs in observers]
    sums = np.concatenate(pieces)
    if sums.size:  # the same on every rank: the sizes agree
        sums = _all_reduce(torch.from_numpy(sums), dist.ReduceOp.SUM, group).numpy()
    for obs, seen, piece in zip(observers, values_seen, _split(sums, pieces), strict=True):
        obs.load_sums(piece, seen)


def _split(flat: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    return np.split(flat, np.cumsum([p.size for p in like])[:-1])


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
        if isinstance(q, Quantizer) and q.kind == "activation" and q.qstate is QState.CALIBRATING
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
