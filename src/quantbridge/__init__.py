"""quantbridge: INT8 (and lower-bit) quantization that moves losslessly between PyTorch and ONNX.

import quantbridge as qb
qmodel = qb.quantize(model, calib_data, recipe="int8")
qb.export(qmodel, "model.int8.onnx", example_inputs=x)
"""

from ._version import __version__ as __version__
from .numerics import PerChannel, PerTensor, QScheme
from .onnx import export, import_onnx
from .recipe import Recipe, Rule, TensorRecipe
from .torch import (
    CaptureError,
    CheckpointError,
    QuantModel,
    assert_quantizers_synchronized,
    float_mode,
    freeze_batchnorm,
    freeze_observers,
    load,
    local_statistics,
    prepare_qat,
    quantize,
    save,
    sync_observers,
)

__all__ = [
    "CaptureError",
    "CheckpointError",
    "PerChannel",
    "PerTensor",
    "QScheme",
    "QuantModel",
    "Recipe",
    "Rule",
    "TensorRecipe",
    "assert_quantizers_synchronized",
    "export",
    "float_mode",
    "freeze_batchnorm",
    "freeze_observers",
    "import_onnx",
    "load",
    "local_statistics",
    "prepare_qat",
    "quantize",
    "save",
    "sync_observers",
]
