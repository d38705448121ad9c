"""quantbridge: INT8 (and lower-bit) quantization that moves losslessly between PyTorch and ONNX.

import quantbridge as qb
qmodel = qb.quantize(model, calib_data, recipe="int8")
qb.export(qmodel, "model.int8.onnx", example_inputs=x)
fast = qb.to_engine(qmodel, "onnxruntime", example_inputs=x)  # fast(x): INT8 in ONNX Runtime
"""

import importlib
from typing import TYPE_CHECKING

from ._version import __version__
from .numerics import PerChannel, PerTensor, QScheme
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
from .torch import _checkpoint as _torch_checkpoint

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

if TYPE_CHECKING:  # the names below load on first use (``__getattr__``)
    from .debug import CompareResult, compare, sensitivity
    from .engine import EngineModel, integer_mode, to_engine
    from .integer import IntegerProgram, LoweringError, lower
    from .onnx import export, fold, import_onnx, openvino_layout, quantize_onnx

# The layers above torch load on first use of one of their names: ``import quantbridge`` then
# imports numerics, recipe and torch only, not the onnx package with ml_dtypes, onnxscript,
# onnxruntime or the HTML report: 1.9 s -> 0.25 s on top of torch (``python -X importtime``,
# 2026-12-02, tests/test_import_time.py). ``qb.load`` of an engine checkpoint imports its layer itself
# (``FORMAT_MODULES``); ``qb.save`` of one is only reached after ``to_engine`` loaded it.
_LAZY = {
    **dict.fromkeys(("EngineModel", "integer_mode", "to_engine"), "engine"),
    **dict.fromkeys(("IntegerProgram", "LoweringError", "lower"), "integer"),
    **dict.fromkeys(("export", "fold", "import_onnx", "openvino_layout", "quantize_onnx"), "onnx"),
    **dict.fromkeys(("CompareResult", "compare", "sensitivity"), "debug"),
}
_LAYERS = {"debug", "engine", "integer", "onnx"}
_torch_checkpoint.FORMAT_MODULES["quantbridge-engine"] = "quantbridge.engine._checkpoint"


def __getattr__(name: str):
    layer = _LAZY.get(name, name if name in _LAYERS else None)
    if layer is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{layer}")  # not ``from .``: asks this hook
    value = module if name == layer else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _LAYERS)
