"""Does a call fit the model? Checked before torch runs it, so a mistake is one line that names it.

Three checks, each with the fix in its message:

* ``bind_first_batch``: the first calibration batch against ``forward``'s signature. A DataLoader
  of ``(inputs, labels)`` passed as is becomes ``model(inputs, labels)``; without this check
  torch.export fails deep inside with "too many positional arguments" and capture advice that
  does not apply.
* ``cast_float64``: float64 (and float16, bfloat16) calibration batches for a float32 model are
  cast to float32, and said once (a ``UserWarning``), instead of failing inside the first convolution.
* ``check_call`` (a forward pre-hook of every ``QuantModel``, and ``qb.export``'s example
  inputs): each input tensor against the placeholder the model was captured with - rank,
  dtype, and every dimension that capture fixed. Torch's own check is a guard assertion
  (``Guard failed: x.size()[2] == 32``) or a symbolic name (``s77``); ours names the input, the
  expected and received shapes and the ``dynamic=`` option that accepts them. A model captured
  from keyword inputs (dict batches) called with positional ones gets them bound by the user's
  ``forward``, as the user's model would (``_positional``).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.fx._pytree import tree_flatten_spec
from torch.utils._pytree import tree_map

from ._batches import as_call, describe
from ._capture import user_stacklevel
from ._positional import default_text, forward_parameters, is_default, to_capture_layout


def bind_first_batch(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """TypeError naming the fix when the first batch cannot be passed to ``model.forward``."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **kwargs)
        return
    except TypeError as e:
        reason = str(e)
    message = (
        f"calibration batch 0 {describe(args, kwargs)} does not fit "
        f"{type(model).__name__}.forward{signature}: {reason}"
    )
    if len(args) >= 2 and not kwargs and _binds(signature, args[:1]):
        message += (
            f". A batch of {len(args)} items (a DataLoader of (inputs, labels)?) is passed as "
            f"{len(args)} positional inputs: pass transform=lambda b: b[0] to calibrate on the "
            "inputs only"
        )
    raise TypeError(message + _keyword_fix(signature, args, kwargs))


def _keyword_fix(signature: inspect.Signature, args: tuple, kwargs: dict) -> str:
    """The transform that makes a dict batch with extra keys (labels), or a tensor batch for a
    keyword-only forward, fit ``signature``; '' when neither applies."""
    params = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return ""
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    extra = [k for k in kwargs if k not in names]
    if kwargs and extra and not args:
        keep = [k for k in kwargs if k in names]
        missing = [n for n in names if n not in kwargs]
        if not keep:  # no key is an input: the keys are named differently from forward's inputs
            pairs = ", ".join(f"{n!r}: b[{k!r}]" for n, k in zip(missing, extra, strict=False))
            return (
                f". None of the batch's keys {extra} is an input of forward {names}: rename them, "
                f"e.g. transform=lambda b: {{{pairs}}}"
            )
        return (
            f". The batch's keys {extra} are not inputs of forward (labels?): pass "
            f"transform=lambda b: {{k: b[k] for k in {keep}}} to calibrate on the inputs only"
        )
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    if args and not positional and len(args) <= len(keyword_only):
        pairs = ", ".join(f"{name!r}: b[{i}]" for i, name in enumerate(keyword_only[: len(args)]))
        if len(args) == 1:
            pairs = f"{keyword_only[0]!r}: b"
        return (
            f". forward takes keyword-only inputs {keyword_only}: make each batch a dict, "
            f"e.g. transform=lambda b: {{{pairs}}}"
        )
    return ""


def _binds(signature: inspect.Signature, args: tuple) -> bool:
    try:
        signature.bind(*args)
    except TypeError:
        return False
    return True


def float_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating-point parameter (or buffer)."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None


_OTHER_FLOATS = (torch.float64, torch.float16, torch.bfloat16)


def cast_float64(args: tuple, kwargs: dict, model_dtype: torch.dtype | None, warned: list):
    """float64 / float16 / bfloat16 tensors cast to float32 when the model is float32; warns once
    per ``warned``. (A half batch would otherwise fail in the first layer with torch's "Input type
    (c10::Half) and bias type (float) should be the same", an error without the input's name.)"""
    if model_dtype != torch.float32:
        return args, kwargs

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype in _OTHER_FLOATS:
            if not warned:
                warned.append(True)
                dtype = str(x.dtype).replace("torch.", "")
                warnings.warn(
                    f"calibration batches are {dtype} and the model's weights float32: casting "
                    "the batches to float32 (pass float32 tensors, e.g. x.float(), to silence "
                    "this)",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
            return x.float()
        return x

    return tree_map(cast, tuple(args)), tree_map(cast, dict(kwargs))


def check_call(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call in the capture's layout (positional inputs of a keyword capture bound by the
    user's ``forward``, ``_positional``); ValueError naming the input when it does not fit the
    captured placeholders."""
    spec = getattr(module, "_in_spec", None)
    if spec is None:
        return args, kwargs
    args, kwargs = _positional(module, args, kwargs)
    checked = args, kwargs
    try:
        flat = tree_flatten_spec((tuple(args), dict(kwargs)), spec)
    except Exception:  # noqa: BLE001 - a different structure: torch's own error says which
        return checked
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat):
        return checked
    capture = getattr(module, "qb_capture", {})
    dynamic = "file" if capture.get("made_by") == "import_onnx" else capture.get("dynamic", "batch")
    names = input_names(module) or [str(n.target) for n in placeholders]
    if len(names) != len(placeholders):
        names = [str(n.target) for n in placeholders]
    for node, name, value in zip(placeholders, names, flat, strict=True):
        expected = node.meta.get("val")
        if isinstance(expected, torch.Tensor) and isinstance(value, torch.Tensor):
            _check_tensor(name, expected, value, dynamic)
        elif isinstance(expected, torch.Tensor) and isinstance(value, np.ndarray):
            # the graph would fail deep inside torch ("'int' object is not callable")
            raise TypeError(
                f"input {name!r} is a numpy array {value.dtype}{list(value.shape)}; the model "
                f"takes torch tensors: pass torch.from_numpy(x)"
            )
    return checked


def _positional(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call in the capture's layout: positional inputs beyond those the capture took are
    bound by the user's ``forward`` (``_positional``); unchanged where the source model is
    unknown or the call has no more positional inputs than the capture."""
    spec = getattr(module, "qb_capture", {}).get("inputs") or {}
    source = module.__dict__.get("_qb_source")
    if source is not None and "args" in spec and kwargs:
        kwargs = _captured_keywords(module, source, kwargs)
    if source is None or "args" not in spec or len(args) <= len(spec["args"]):
        return args, kwargs  # nothing to map (the common call: no signature read)
    parameters = forward_parameters(source.forward)
    if parameters is None:
        return args, kwargs
    mapped = to_capture_layout(parameters, len(spec["args"]), list(spec["kwargs"]), args, kwargs)
    if mapped is None:
        return args, kwargs
    defaults = {p[0]: p[2] for p in parameters}
    for name, entry in spec["kwargs"].items():
        if name not in mapped[1]:
            value = f" (captured as {name}={entry['value']!r}: pass it)" if "value" in entry else ""
            default = defaults.get(name, {})
            if not value and "constant" in default:  # forward(x, mask=None) calibrated with a mask
                value = (
                    f" (forward's default {name}={default['constant']!r} was not captured: the "
                    f"calibration batches gave {name}; pass it, or quantize with batches without "
                    "it to run without it)"
                )
            raise TypeError(
                f"missing input {name!r}{value}; the model was captured with the keyword inputs "
                f"{list(spec['kwargs'])}"
            )
    return mapped


def _captured_keywords(module: nn.Module, source: nn.Module, kwargs: dict) -> dict:
    """``kwargs`` less the optional inputs the capture did not take that hold their default
    (``flip=False``, as the capture ran it); TypeError naming one that does not: the graph has no
    input for it, and torch's "unexpected keyword argument" does not say why."""
    try:
        taken = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return kwargs
    extra = [k for k in kwargs if k not in taken]
    parameters = forward_parameters(source.forward) if extra else None
    if not parameters:
        return kwargs
    defaults = {name: default for name, _, default in parameters}
    kept = dict(kwargs)
    for name in extra:
        if name not in defaults:
            continue  # not forward's: torch's own error names it
        default = defaults[name]
        if is_default(kwargs[name], default):
            del kept[name]
            continue
        shown = default_text(default)
        raise TypeError(
            f"input {name!r} was not given in the calibration batches, so the model was captured "
            f"with forward's default {name}={shown}, and {name}={kwargs[name]!r} cannot change "
            f"it; quantize with batches that give {name} (a dict batch {{..., {name!r}: ...}})"
        )
    return kept


def input_names(module: nn.Module) -> list[str] | None:
    """The names of the captured inputs, one per placeholder, as the user knows them, where
    they differ from the traced ones: an imported ONNX file's graph inputs (``input.1``, not
    ``input_1``; ``qb_capture["io_names"]``). None for any other model."""
    capture = getattr(module, "qb_capture", {})
    io, spec = capture.get("io_names"), capture.get("inputs")
    if not io or not spec:
        return None
    pairs = [tuple(p) for p in io["inputs"]]
    by_parameter = dict(pairs)
    if len(spec["args"]) > len(pairs):
        return None
    names = [pairs[i][1] for i in range(len(spec["args"]))]
    return names + [by_parameter.get(key, key) for key in spec["kwargs"]]


def _check_tensor(name: str, expected: torch.Tensor, got: torch.Tensor, dynamic: str) -> None:
    if isinstance(got, torch._subclasses.FakeTensor) or not all(
        isinstance(d, int) for d in got.shape
    ):
        return  # being traced (export): the sizes are symbolic, torch checks them itself
    want = _shape(expected)
    if got.dtype != expected.dtype:
        raise ValueError(
            f"input {name!r} is {_dtype(got)}{list(got.shape)}; the model was captured with "
            f"{_dtype(expected)}{want}: pass x.to(torch.{_dtype(expected)})"
        )
    if got.ndim != expected.ndim:
        raise ValueError(
            f"input {name!r}: expected {expected.ndim} dimensions {want}, got {got.ndim} "
            f"{list(got.shape)}"
        )
    for axis, (size, fixed) in enumerate(zip(got.shape, expected.shape, strict=True)):
        if isinstance(fixed, int) and size != fixed:
            raise ValueError(
                f"input {name!r}: expected shape {want}, got {list(got.shape)}: dimension "
                f"{axis} is fixed to {fixed}; {_fix(axis, dynamic)}"
            )


def _fix(axis: int, dynamic: str) -> str:
    if dynamic == "file":  # a quantized ONNX file, imported: its declared input shapes
        return "the ONNX file declares it fixed; a file with it dynamic (dim_param) accepts others"
    if dynamic == "none":
        option = "batch" if axis == 0 else "all"
        return f'quantize with dynamic="{option}" to accept other sizes (it used dynamic="none")'
    if dynamic == "batch" and axis > 0:
        return 'quantize with dynamic="all" to accept other sizes (it used dynamic="batch")'
    return f'the model itself fixes it (captured with dynamic="{dynamic}")'


def _shape(t: torch.Tensor) -> str:
    """``[batch, 3, 32, 32]``: fixed sizes as numbers, dynamic ones by role, never ``s77``."""
    names = ["batch"] + ["*"] * (t.ndim - 1)
    return (
        "["
        + ", ".join(str(d) if isinstance(d, int) else names[i] for i, d in enumerate(t.shape))
        + "]"
    )


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def check_example(module: nn.Module, example_inputs: Any) -> tuple[tuple, dict]:
    """``example_inputs`` (one batch, ``as_call``) checked by ``check_call``; a list of several
    batches - the calibration list passed where one batch belongs - gets the hint to pass one."""
    args, kwargs = as_call(example_inputs, "example_inputs")
    try:
        return check_call(module, args, kwargs)
    except TypeError as e:
        if isinstance(example_inputs, list) and len(example_inputs) > 1:
            n = len(example_inputs)
            raise TypeError(
                f"{e}. example_inputs is one batch (a tensor, a tuple of positional inputs or a "
                f"dict); a list of {n} is read as {n} positional inputs: for a list of "
                "calibration batches pass one of them, e.g. example_inputs=batches[0]"
            ) from None
        raise


def check_call_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``register_forward_pre_hook(check_call_hook, with_kwargs=True)``: the call checked, in
    the capture's layout."""
    return check_call(module, args, kwargs)
