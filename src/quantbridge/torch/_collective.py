"""Process-group primitives for the torch layer: when statistics are combined, where collective
tensors live, and the batch range of a DDP forward. Nothing here knows a quantizer or an
observer; ``_fakequant`` (range tracking in QAT) and ``_distributed`` (combining calibration
statistics) build on it.

``local_statistics()`` turns every collective of calibration and QAT range tracking off for the
block (for a process group where only some ranks quantize).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

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


def all_gather(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``(world, *t.shape)``: every rank's ``t`` (same shape and dtype on every rank)."""
    t = t.to(_device(group))
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return torch.stack(out).cpu()


def all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None):
    """``t`` reduced by ``op`` over ``group``, back on the CPU."""
    t = t.to(_device(group))
    dist.all_reduce(t, op=op, group=group)
    return t.cpu()


def ddp_batch_range(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inside a DDP forward: ``(min, max)`` of the batch over every rank of the DDP's group.

    Called by a tracking ``Quantizer``; outside DDP (or inside ``local_statistics()``)
    ``(lo, hi)`` unchanged, without a collective.
    """
    ddp = getattr(nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None or _LOCAL.get():
        return lo, hi
    group = ddp.process_group
    if dist.get_world_size(group) == 1:
        return lo, hi
    both = all_reduce(torch.stack([-lo, hi]).double(), dist.ReduceOp.MAX, group).to(lo.device)
    return -both[0], both[1]
