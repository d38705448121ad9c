"""Capture of the user's model as an aten-level ``torch.fx.GraphModule``.

We capture with ``torch.export.export(model, args, kwargs, strict=False).module()``, not
``torch.fx.symbolic_trace``:

* symbolic tracing fails on real models (Hugging Face BERT/MiniLM with transformers 5.x raises
  "'Proxy' object does not support item assignment"); non-strict export runs the Python code for
  real and records what it did, so control flow on values and shape arithmetic just work;
* functional ops (``x + y``, ``torch.cat``, ``@``) appear as aten nodes next to module calls, so
  placement treats ``torch.add`` and ``nn.Linear`` alike;
* ``ep.module()`` keeps every parameter at its original fully-qualified name (state-dict keys are
  unchanged) and each node's ``nn_module_stack`` metadata names the user module it came from.

Dynamic dimensions (``dynamic=``): ``"batch"`` (default) marks dimension 0 of every input
``Dim.AUTO`` (dynamic unless the model pins it), so the captured model accepts other batch sizes;
``"all"`` marks every dimension (other image sizes and sequence lengths too; capture takes about
2.5x longer on a MobileNetV2; a capture past its time limit, ``_deadline``, is redone with
``"batch"`` and a warning); ``"none"`` keeps the example's shapes. A size-1 dimension would be
specialised to 1 by export, so example batches of size 1 are repeated to 2 first.

The captured graph's in-place ops become functional (``_passes.out_of_place``), and convs with a
string padding (``padding="same"``) integer-padding ones (``_conv_padding``).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import logging
import os
import re
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ._autocast import inline_autocast_off
from ._batches import describe
from ._conv_padding import explicit_conv_padding
from ._deadline import CaptureTimeout, capture_budget, deadline
from ._linear_products import linear_products
from ._passes import out_of_place, written_inputs
from ._sdpa import decompose_sdpa

_OUR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_DIRS = (_OUR_DIR, os.path.dirname(os.path.abspath(torch.__file__)), "<")


def _is_user_file(filename: str) -> bool:
    return not filename.startswith(_LIBRARY_DIRS) and "/site-packages/" not in filename


# torch loggers that print what users cannot act on ("torchvision is not installed. Skipping
# torchvision::nms", four lines per export)
_NOISY_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "onnxscript")
# and those that log a failing capture's internals (a fake-tensor traceback, "Unable to find user
# code corresponding to {u0}") before the exception that CaptureError re-states for the user
_FAILURE_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")
# torch's own deprecations met inside torch (deepcopy of a captured module builds a LeafSpec)
_FOREIGN_WARNINGS = (r".*LeafSpec.*",)
# and its advice about nn.LSTM / nn.GRU's internal weight list, which torch itself assigns on every
# call ("The tensor attributes self.rnn._flat_weights[0], ... were assigned during export")
_FOREIGN_USER_WARNINGS = (r"The tensor attributes .*_flat_weights.* were assigned during export",)


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Foreign noise off for the duration: torch's exporter loggers at ERROR, torch-internal
    deprecation warnings ignored. quantbridge's own warnings still show."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS + _FAILURE_LOGGERS]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL if lg.name in _FAILURE_LOGGERS else logging.ERROR)
    try:
        with warnings.catch_warnings():
            for pattern in _FOREIGN_WARNINGS:
                warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)
            for pattern in _FOREIGN_USER_WARNINGS:
                warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
            yield
    finally:
        for lg, level in zip(loggers, saved, strict=True):
            lg.setLevel(level)


def user_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` call made here or below, such that the warning
    points at the innermost frame of the user's code (not quantbridge's, torch's or a package's)."""
    frame, level = inspect.currentframe(), 0
    while frame is not None and not _is_user_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return max(level, 1)  # level 1 = the frame calling warn(), as warn's own stacklevel counts


class CaptureError(RuntimeError):
    """The model could not be captured; the message names the user's line and what to do."""


def _widen_batch(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.ndim >= 1 and x.shape[0] == 1:
        return x.repeat(2, *([1] * (x.ndim - 1)))
    return x


def _contiguous(x: Any) -> Any:
    # a strided example (x[::2]) would make export guard on its strides and refuse later batches
    return x.contiguous() if isinstance(x, torch.Tensor) else x


DYNAMIC_CHOICES = ("batch", "all", "none")


def widen_batch(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Repeat size-1 batches to 2 so that export keeps the batch dimension dynamic."""
    return tree_map(_widen_batch, tuple(args)), tree_map(_widen_batch, dict(kwargs))


def capture(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    dynamic: str = "batch",
    budget_s: float | None = None,
    explicit_padding: bool = True,
) -> torch.fx.GraphModule:
    """Export ``model(*args, **kwargs)`` to a GraphModule with dynamic dimensions.

    ``dynamic="all"`` gets ``budget_s`` seconds (default ``capture_budget()``, see ``_deadline``);
    past it the capture is redone with ``dynamic="batch"`` and a warning names the dimensions
    that became static. ``explicit_padding=False`` keeps string-padding convs as captured (float:
    what checkpoints saved before ``_conv_padding`` existed were placed on).
    """
    args, kwargs = tree_map(_contiguous, tuple(args)), tree_map(_contiguous, dict(kwargs))
    if dynamic != "none":
        args, kwargs = widen_batch(args, kwargs)
    spec = dynamic_shapes(model.forward, args, kwargs, dynamic)
    limit = (capture_budget() if budget_s is None else budget_s) if dynamic == "all" else None
    try:
        with torch.no_grad(), quiet_torch(), deadline(limit), _no_partial_graph():
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=spec, strict=False)
    except CaptureTimeout:
        warnings.warn(fallback_message(spec, limit), stacklevel=user_stacklevel())
        return capture(model, args, kwargs, "batch", explicit_padding=explicit_padding)
    except Exception as e:  # noqa: BLE001 - re-raised with the user's line and a fix
        raise CaptureError(_explain(model, e, args, kwargs)) from e
    gm = ep.module()
    gm.qb_dynamic = dynamic  # what the graph holds: "batch" after a fallback from "all"
    gm.qb_shape_ranges = dict(ep.range_constraints)  # export reuses the graph (one trace)
    inline_autocast_off(gm)  # ``with torch.autocast(enabled=False)``: its ops placed like others
    out_of_place(gm)  # ``out += identity`` -> aten.add: the op tables know functional ops only
    if explicit_padding:
        explicit_conv_padding(gm)  # conv2d.padding (padding="same") -> conv2d: the tables know it
    decompose_sdpa(gm)  # SDPA as eager attention: both forms get the same placement
    linear_products(gm)  # x @ w.T (Falcon's linears) -> aten.linear: the tables know it
    return gm


def refuse_written_inputs(model: nn.Module, gm: torch.fx.GraphModule) -> None:
    """CaptureError naming the input ``forward`` writes in place, and its line (``prepare``'s
    check; ``capture`` itself keeps the write): quantize runs
    each calibration batch more than once, each run would see the last one's writes."""
    written = written_inputs(gm)
    if not written:
        return
    name, node = written[0]
    sites = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', node.meta.get("stack_trace") or "")
    sites = [s for s in sites if _is_user_file(s[0])][-1:]
    where = "".join(
        f' at {f}:{n} in {fn}(): "{linecache.getline(f, int(n)).strip()}"' for f, n, fn in sites
    )
    op = str(node.target).split(".")[-2] if "." in str(node.target) else str(node.target)
    raise CaptureError(
        f"{type(model).__name__}.forward writes its input {name!r} in place ({op}){where}: "
        "quantize runs every calibration batch several times, and each run would read what the "
        f"last one wrote; compute out of place instead ({name} = {name} * 2, not {name}.mul_(2))"
    )


@contextlib.contextmanager
def _no_partial_graph() -> Iterator[None]:
    """stderr as it was, less the partial graph torch.export prints there when it fails (aten
    code with ``arg0_1`` names, twice for a data-dependent branch): CaptureError says what failed
    at the user's line. Everything else written meanwhile is passed on."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    except BaseException as e:
        text, graph = buffer.getvalue(), getattr(e, "partial_fx_graph", None)
        if graph is not None:
            text = text.replace(f"{graph}\n", "")
        sys.stderr.write(text)
        raise
    sys.stderr.write(buffer.getvalue())


def declared_dims_fixed(model: nn.Module, dynamic: str) -> str | None:
    """A warning when ``dynamic`` fixes dimensions that ``model`` declares dynamic (an imported
    ONNX file's ``dynamic_dims``: input name -> {axis: label}); None when it fixes none."""
    declared = getattr(model, "dynamic_dims", None)
    if dynamic == "all" or not isinstance(declared, dict):
        return None
    fixed = [
        f"{name}[{axis}] ({label!r})"
        for name, dims in declared.items()
        for axis, label in sorted(dims.items())
        if dynamic == "none" or axis != 0
    ]
    if not fixed:
        return None
    return (
        f"quantbridge: the model's ONNX file declares {', '.join(fixed)} dynamic, but "
        f"dynamic={dynamic!r} fixes {'it' if len(fixed) == 1 else 'them'} to the example's "
        "sizes in the quantized model and its export; pass dynamic='all' to keep "
        f"{'it' if len(fixed) == 1 else 'them'} dynamic"
    )


_DONE = {"capture": "captured", "export": "exported"}


def fallback_message(spec: Any, limit: float, what: str = "capture") -> str:
    """The warning after a ``dynamic="all"`` trace ran past ``limit`` and was redone with
    ``"batch"`` (``what``: "capture" in ``quantize``, "export" for the exporter's own trace)."""
    static = []
    for name, dims in (spec or {}).items():
        if isinstance(dims, dict) and all(isinstance(k, int) for k in dims):
            if len(dims) > 1:
                static.append(f"{name}[{', '.join(str(d) for d in sorted(dims) if d)}]")
        elif dims is not None:
            static.append(f"{name} (all but dimension 0 of each tensor)")
    return (
        f"quantbridge: {what} with dynamic='all' took longer than {limit:g} s (torch.export's "
        f"symbolic shape reasoning), so the model was {_DONE[what]} with dynamic='batch': "
        "dimensions "
        f"{', '.join(static) or '(none)'} are static, fixed to the example's sizes. Pass "
        "dynamic='batch' to skip the attempt, or set QB_CAPTURE_BUDGET_S (seconds, or 'none') "
        "to allow a longer capture"
    )


def dynamic_shapes(forward, args: tuple, kwargs: dict, dynamic: str) -> Any:
    """``dynamic_shapes`` for ``torch.export`` keyed by ``forward``'s argument names."""
    if dynamic not in DYNAMIC_CHOICES:
        raise ValueError(f"dynamic={dynamic!r}: use one of {DYNAMIC_CHOICES}")
    if dynamic == "none":
        return None

    def dims(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            return None
        return {i: torch.export.Dim.AUTO for i in (range(x.ndim) if dynamic == "all" else [0])}

    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params) or len(args) > len(names):
        return None  # *args signatures: let export infer (static shapes)
    spec = {names[i]: tree_map(dims, a) for i, a in enumerate(args)}
    spec.update({k: tree_map(dims, v) for k, v in kwargs.items()})
    return spec


def _explain(model: nn.Module, e: Exception, args: tuple = (), kwargs: dict | None = None) -> str:
    """The innermost frame of user code in the traceback, with its source line and a fix."""
    frames = []
    err: BaseException | None = e
    while err is not None and len(frames) < 10_000:  # the whole chain: torch re-raises
        frames = traceback.extract_tb(err.__traceback__) + frames
        err = err.__cause__ or err.__context__
    user = [f for f in frames if _is_user_file(f.filename)]
    where = ""
    located = [(f.filename, f.lineno, f.name) for f in user]
    # torch.export puts the offending user frame in its message, not in the traceback
    located += [
        (fn, int(ln), name)
        for fn, ln, name in re.findall(r'File "([^"]+)", line (\d+), in (\w+)', str(e))
        if _is_user_file(fn)
    ]
    located += _guard_site(str(e), frames)
    if not located:  # else the innermost line of a library the model is written in (transformers)
        located = [
            (f.filename, f.lineno, f.name)
            for f in frames
            if not f.filename.startswith(_LIBRARY_DIRS) and os.path.isfile(f.filename)
        ][-1:]
    if located:
        filename, lineno, func = located[-1]
        line = linecache.getline(filename, lineno).strip()
        where = f' at {filename}:{lineno} in {func}(): "{line}"'
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    first = re.sub(r"\bs\d+\b", "N", first)  # export's symbol for a dynamic size (s77) means N
    return (
        f"could not capture {type(model).__name__}{where}: {type(e).__name__}: {first}\n"
        + _advice(model, e, args, dict(kwargs or {}))
    )


def _guard_site(text: str, frames: list) -> list[tuple[str, int, str]]:
    """The line a data-dependent guard came from. torch names it by a path shortened to a
    suffix ("Caused by: (transformers/models/longformer/modeling_longformer.py:549 in forward)"):
    the traceback frame whose file ends with it, else that suffix on sys.path. A library's line
    (a Hugging Face model's own code) is what to name there; torch's own (its __torch_function__
    for a user's `if x.sum() > 0`) is not."""
    found = re.search(r"Caused by: \(([^()\s]+\.py):(\d+) in (\w+)\)", text)
    if not found:
        return []
    short, lineno, func = found.group(1), int(found.group(2)), found.group(3)
    candidates = [f.filename for f in frames if f.filename.endswith(short)]
    candidates += [os.path.join(root, short) for root in sys.path]
    return [
        (path, lineno, func)
        for path in candidates
        if os.path.isfile(path) and not path.startswith(_LIBRARY_DIRS)  # not torch's, not ours
    ][:1]


# torch's messages for an input of the wrong dtype, device or shape (the data, not the code)
_DTYPE = re.compile(
    r"Input type|expected scalar type|should be the same|same dtype|found dtype"
    r"|could not infer output dtype|must be either a floating point|not implemented for '(Byte|Char"
    r"|Short|Int|Long)'"
)


def dtype_fix(text: str, model_dtype: torch.dtype | None) -> str:
    """The fix for torch's message ``text`` about a batch of the wrong dtype ('' when it is not
    one): integer images reach a float layer (a bias-free conv accepts them; a mean fails)."""
    if model_dtype is None or not _DTYPE.search(text):
        return ""
    dtype = str(model_dtype).replace("torch.", "")
    cast = "x.float()" if model_dtype == torch.float32 else f"x.to(torch.{dtype})"
    return f"pass {dtype} tensors ({cast}; images as integers need {cast} / 255 as in training)"


_INDICES = re.compile(r"'indices' to have one of the following scalar types")
_DEVICE = re.compile(r"device")
_SHAPE = re.compile(
    r"expected \d+D|to have \d+ channels|cannot be multiplied|size mismatch|must match the size"
    r"|same reduction dim|normalized_shape|Expected .*dimension|Expected .*size"
)


def _failing_layer(model: nn.Module, e: BaseException) -> str:
    """'layer NAME (Class)' for the innermost submodule of ``model`` whose forward raised ``e``
    (non-strict export runs the user's modules themselves), else 'the layer at that line'."""
    names = {id(m): name for name, m in model.named_modules() if name}
    found = "the layer at that line"
    err: BaseException | None = e
    for _ in range(100):  # the chain of re-raised exceptions
        if err is None:
            break
        tb = err.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if id(owner) in names and tb.tb_frame.f_code.co_name == "forward":
                found = f"layer {names[id(owner)]!r} ({type(owner).__name__})"
            tb = tb.tb_next
        err = err.__cause__ or err.__context__
    return found


def _runs_eagerly(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a plain call on the same inputs runs (a capture-only shape error is the code's)."""
    try:
        with torch.no_grad(), quiet_torch():
            model(*args, **kwargs)
    except Exception:  # noqa: BLE001 - any failure: the inputs may be what is wrong
        return False
    return True


def _advice(model: nn.Module, e: BaseException, args: tuple, kwargs: dict) -> str:
    """What to change: the inputs when torch's error is about their dtype, device or shape, the
    output type when export does not know it, else the code at the user's line."""
    text, layer = str(e), _failing_layer(model, e)
    inputs = f"the inputs {describe(args, kwargs)}"
    param = next(iter(model.parameters()), None)
    if _INDICES.search(text):
        return f"{inputs} feed {layer} float values where it takes indices: pass int64 token ids"
    if _DTYPE.search(text) and param is not None:
        dtype = str(param.dtype).replace("torch.", "")
        return f"{inputs} do not have the dtype {layer} computes in ({dtype}): " + dtype_fix(
            text, param.dtype
        )
    if param is not None and param.device.type == "meta":
        return (
            "the model's weights are on the 'meta' device (shapes, no values: built under "
            "torch.device('meta') or init_empty_weights): load them first, e.g. "
            "model.load_state_dict(state_dict, assign=True), or model.to_empty(device='cpu') "
            "and then load_state_dict"
        )
    if _DEVICE.search(text) and param is not None:
        return (
            f"{inputs} are not on the model's device ({param.device}): move the batches "
            "(x.to(device)) or the model (model.to(device)) so that they match"
        )
    if _SHAPE.search(text) and _runs_eagerly(model, args, kwargs):
        return (
            f"the model runs on {describe(args, kwargs)} when called; {layer} fails only when "
            "traced: its code takes another path under torch.export at that line (e.g. Hugging "
            "Face builds a full (batch, 1, seq, seq) attention mask when traced, where a plain "
            "call skips an all-ones mask). The model's code, not the inputs, needs the change "
            "there; or quantize the submodules around that layer and keep it in float"
        )
    if _SHAPE.search(text):
        return (
            f"{inputs} do not have the shape {layer} expects: check the layout "
            "(channels first, N x C x H x W for convolutions), the number of dimensions (a batch "
            "dimension first) and the feature size"
        )
    unknown = re.search(r"Found <class '([\w.]+)'> in output, which is not a known type", text)
    if unknown:
        name = unknown.group(1).rsplit(".", 1)[-1]
        return (
            f"the model returns a {name}, which torch.export cannot look into: register it "
            f"(torch.export.register_dataclass({name}) for a dataclass, "
            "torch.utils._pytree.register_pytree_node otherwise) or return a tensor, tuple or dict"
        )
    if "GuardOnDataDependentSymNode" in type(e).__name__ or "data-dependent expression" in text:
        return (
            f"{layer} takes a Python branch on a value computed from the inputs at that line "
            "(an `if` on a tensor, `.item()`, `.any()`); torch.export records one path and cannot "
            "choose it by value. Fixes: compute both paths with torch.where or torch.cond at that "
            "line, or quantize the submodules around it (qb.quantize on each part that captures) "
            "and keep it in float"
        )
    return (
        "quantbridge captures models with torch.export (non-strict). Common fixes: avoid "
        "data-dependent Python control flow on tensor values at that line (use torch.where / "
        "torch.cond), do not call .item()/.tolist()/numpy() inside forward, and pass all model "
        "inputs as tensors. You can also quantize a submodule that captures and keep the rest "
        "in float."
    )
