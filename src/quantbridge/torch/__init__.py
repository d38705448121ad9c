"""The torch layer: capture, placement, fake quantization with straight-through gradients,
``QuantModel``. Public names are re-exported from ``quantbridge``."""

from ._capture import CaptureError
from ._checkpoint import CheckpointError, load, save
from ._model import QuantModel, float_mode
from ._qat import freeze_batchnorm, freeze_observers, prepare_qat
from ._quantize import freeze, prepare, quantize

__all__ = [
    "CaptureError",
    "CheckpointError",
    "QuantModel",
    "float_mode",
    "freeze",
    "freeze_batchnorm",
    "freeze_observers",
    "load",
    "prepare",
    "prepare_qat",
    "quantize",
    "save",
]
