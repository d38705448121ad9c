"""quantbridge: INT8 (and lower-bit) quantization that moves losslessly between PyTorch and ONNX.

import quantbridge as qb
qmodel = qb.quantize(model, calib_data, recipe="int8")
qb.export(qmodel, "model.int8.onnx", example_inputs=x)
fast = qb.to_engine(qmodel, "onnxruntime", example_inputs=x)  # fast(x): INT8 in ONNX Runtime
"""

from ._version import __version__
from .engine import EngineModel, integer_mode, to_engine
from .integer import IntegerProgram, LoweringError, lower
from .numerics import PerChannel, PerTensor, QScheme
from .onnx import export, fold, import_onnx, openvino_layout, quantize_onnx
from .recipe import AdaRound, Recipe, Rule, TensorRecipe
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
    set_progress,
    sync_observers,
)

__all__ = [
    "__version__",
    "CaptureError",
    "CheckpointError",
    "CompareResult",
    "IntegerProgram",
    "LoweringError",
    "EngineModel",
    "PerChannel",
    "PerTensor",
    "QScheme",
    "QuantModel",
    "AdaRound",
    "Recipe",
    "Rule",
    "TensorRecipe",
    "assert_quantizers_synchronized",
    "compare",
    "export",
    "float_mode",
    "fold",
    "freeze_batchnorm",
    "freeze_observers",
    "import_onnx",
    "integer_mode",
    "load",
    "local_statistics",
    "lower",
    "openvino_layout",
    "prepare_qat",
    "quantize",
    "quantize_onnx",
    "save",
    "sensitivity",
    "set_progress",
    "sync_observers",
    "to_engine",
]

# The debug layer (``compare``, ``sensitivity``: ONNX Runtime sessions, the HTML report) loads on
# first use: ``quantize`` and ``export`` never need it, and ``import quantbridge`` then skips it
# and onnxruntime (0.09 of 0.88 CPU s on top of torch, torch.export and onnxscript, 2026-12-01).
_DEBUG_NAMES = {"CompareResult", "compare", "sensitivity", "debug"}


def __getattr__(name: str):
    if name not in _DEBUG_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import quantbridge.debug as debug  # not ``from . import``: it asks this hook first

    value = debug if name == "debug" else getattr(debug, name)
    globals()[name] = value
    return value
