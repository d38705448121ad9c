"""The torch layer: capture, placement, fake quantization with straight-through gradients,
``QuantModel``. Public names are re-exported from ``quantbridge``."""

from ._capture import CaptureError
from ._checkpoint import CheckpointError, load, save
from ._distributed import assert_quantizers_synchronized, local_statistics, sync_observers
from ._model import QuantModel, float_mode
from ._progress import set_progress
from ._qat import freeze_batchnorm, freeze_observers, prepare_qat
from ._quantize import freeze, prepare, quantize

__all__ = [
    "CaptureError",
    "CheckpointError",
    "QuantModel",
    "assert_quantizers_synchronized",
    "float_mode",
    "freeze",
    "freeze_batchnorm",
    "freeze_observers",
    "load",
    "local_statistics",
    "prepare",
    "prepare_qat",
    "quantize",
    "save",
    "set_progress",
    "sync_observers",
]
