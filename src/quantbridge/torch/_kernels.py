"""``faster_kernels()``: within the block, operators of the captured graph for which torch's CPU
kernel is slow run through another kernel that returns the same values.

For the passes that run the captured graph on the calibration data (calibration, bias
correction: ``_quantize``), never for what the user runs. An operator is listed only where the
two kernels select values and never round, so that no order of operations can change a result.

* ``aten.max_pool2d`` on a contiguous (NCHW) float tensor on the CPU: torch's kernel for that
  layout scans each window element by element; on a channels-last copy it vectorizes over the
  channels. ResNet-18-style's stem pool (8 x 64 x 112 x 112, 3x3 stride 2, one thread): 128 ms,
  against 34 ms for copy, pool, copy back -- a quarter of the model's float forward at one
  thread, and the default preset runs three passes (calibration, bias correction's float and
  quantized passes). A maximum is exact in any order: the same values (NaN and infinities
  included, ``tests/torch/test_kernels.py``), in the contiguous layout torch's kernel returns.
  Only without autograd: with it, the kernels' choice among tied elements decides which one the
  gradient goes to.

The block is a ``TorchFunctionMode``: every torch call inside it pays one Python call (~1 us).
It is entered only for a graph that holds one of the operators (the PP-OCRv4 detector, no max
pool, made 80,000 torch calls in calibration and bias correction).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten


def _max_pool2d(x, *args, **kwargs):
    if (
        isinstance(x, torch.Tensor)
        and x.device.type == "cpu"
        and x.ndim == 4
        and x.dtype in (torch.float32, torch.float64)
        and x.is_contiguous()
        and not (torch.is_grad_enabled() and x.requires_grad)
    ):
        wide = x.contiguous(memory_format=torch.channels_last)
        return aten.max_pool2d.default(wide, *args, **kwargs).contiguous()
    return aten.max_pool2d.default(x, *args, **kwargs)


# operator -> a function of the same arguments giving the same values (module docstring)
FASTER = {aten.max_pool2d.default: _max_pool2d}


class _Faster(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kernel = FASTER.get(func)
        if kernel is not None:
            return kernel(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def faster_kernels(gm: torch.fx.GraphModule | None = None) -> Iterator[None]:
    """Within the block, the operators of ``FASTER`` run through their faster kernels; given
    ``gm``, only if its graph calls one of them (else the block runs as it is)."""
    if gm is not None and not any(
        node.op == "call_function" and node.target in FASTER for node in gm.graph.nodes
    ):
        yield
        return
    with _Faster():
        yield


__all__ = ["faster_kernels", "FASTER"]
