"""What ``quantize`` and ``prepare_qat`` accept as the model: a float ``nn.Module`` that
``torch.export`` can capture. Everything else is refused before capture, with the fix: a path, a
class, an ``ExportedProgram``, a ``QuantModel``, a ScriptModule, a model holding ``torch.ao``
quantized layers, a float16 / bfloat16 model. A model whose class overrides ``__call__`` is
quantized from ``forward`` with a warning (the capture does not see ``__call__``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

from ._capture import user_stacklevel
from ._model import QuantModel

# torch's own quantized layers (eager-mode and FX conversions: packed int8 weights)
_TORCH_QUANTIZED = (
    "torch.ao.nn.quantized",
    "torch.nn.quantized",
    "torch.ao.nn.intrinsic.quantized",
)


def check_float_module(model: Any) -> None:
    """TypeError naming the fix for what torch.export cannot capture or should not re-quantize."""
    _check_module(model)
    if isinstance(model, QuantModel):
        raise TypeError(
            "model is already quantized (a QuantModel); quantize the float model it came from "
            "(quantize leaves it unchanged) to use another recipe or other calibration data, or "
            "train this one further as it is (QAT)"
        )
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            f"model is a torch.jit.ScriptModule ({type(model).__name__}, from torch.jit.script or "
            "torch.jit.trace), which torch.export cannot capture; pass the nn.Module you "
            "scripted, or export it to ONNX and use quantize_onnx"
        )
    other = next(
        ((n, t) for n, t in model.named_parameters() if t.dtype in (torch.float16, torch.bfloat16)),
        None,
    )
    if other is not None:  # LLMs are often loaded in bfloat16 / float16 (torch_dtype=...)
        name, t = other
        dtype = str(t.dtype).replace("torch.", "")
        raise TypeError(
            f"the model's weights are {dtype} ({name!r} is the first); quantbridge calibrates "
            "and simulates INT8 on a float32 model: call model.float() first (Hugging Face: "
            "from_pretrained(..., torch_dtype=torch.float32)); the INT8 weights and scales are "
            "chosen from it as from the original"
        )


def _check_module(model: Any) -> None:
    if isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"model is a path ({os.fspath(model)!r}); quantize takes the nn.Module: load it first "
            "(model.load_state_dict(torch.load(path)) into your model class, or "
            "torch.load(path, weights_only=False) for a pickled module); an ONNX file goes to "
            "qb.quantize_onnx(path, calib) or qb.import_onnx(path), a quantbridge checkpoint to "
            "qb.load(path, model)"
        )
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise TypeError(
            f"model is the class {model.__name__}; pass an instance: {model.__name__}()"
        )
    if isinstance(model, torch.export.ExportedProgram):
        raise TypeError(
            "model is a torch.export ExportedProgram; pass the nn.Module you exported (quantize "
            "captures it itself, with a dynamic batch size), or program.module() (it keeps the "
            "shapes it was exported with)"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    quantized = next(
        (
            (n, m)
            for n, m in model.named_modules()
            if type(m).__module__.startswith(_TORCH_QUANTIZED)
        ),
        None,
    )
    if quantized is not None:
        name, layer = quantized
        raise TypeError(
            f"layer {name or 'model'!r} is a torch quantized module "
            f"({type(layer).__module__}.{type(layer).__name__}), already converted to int8 by "
            "torch.ao.quantization; quantize the float model you converted (before "
            "torch.ao.quantization.convert / quantize_dynamic)"
        )
    if type(model).__call__ is not nn.Module.__call__ and not isinstance(
        model, torch.fx.GraphModule
    ):
        warnings.warn(
            f"{type(model).__name__} overrides __call__; quantize captures {type(model).__name__}"
            ".forward only, so the QuantModel runs forward without what __call__ adds; move it "
            "into forward to keep it",
            stacklevel=user_stacklevel(),
        )
