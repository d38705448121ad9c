"""``EngineModel`` and ``to_engine``: the quantized model run by an inference engine, called like
the user's model.

``to_engine(model, engine, example_inputs=..., threads=None, **options)`` takes

* a ``QuantModel``: its QDQ export (``quantbridge.onnx.to_onnx``, the one-trace path) is the
  quantized form; the fp32 export of the same weights (``to_onnx`` under ``float_mode``, taken
  from a snapshot made now, so later training of the QuantModel does not leak in) is the float
  form. ``example_inputs`` defaults to the shapes the QuantModel was captured with, and the
  dynamic dimensions follow its capture (``dynamic="batch"`` or ``"all"``);
* a float ``nn.Module``: its fp32 export (``float_to_onnx``) is the only form;
* an ONNX file (path) or ``onnx.ModelProto``: the graph as stored is the only form (quantized if
  it holds QuantizeLinear/DequantizeLinear or QLinear*/*Integer ops, else float).

``layout`` is the QDQ layout of the quantized form (``quantbridge.export``'s ``target``,
``TARGETS``). By default the engine's own: ``to_engine(qmodel, "openvino")`` runs the OpenVINO
layout (``openvino_layout``: Q/DQ pairs only at the inputs OpenVINO runs in int8, element-wise ops
in float, fused into the convolutions), every other engine the canonical ONNX Runtime layout.
OpenVINO runs the canonical file's roundings after each Add / Mul as stand-alone float
FakeQuantize layers: the PP-OCRv4 detector's ran at 0.6x OpenVINO's float speed, the OpenVINO
layout at 1.2-1.6x (``docs/openvino.md``). ``layout="onnxruntime"`` keeps ONNX Runtime's
numerics in OpenVINO (to compare the engines on one file); ``layout="openvino"`` on ONNX Runtime
runs the OpenVINO file there. An ONNX file runs as stored unless ``layout="openvino"`` is given.
The integer program lowers only the canonical layout. The float form has no Q/DQ: no layout.

The first form is exported at once (so a bad model fails at ``to_engine``); the other form and
each engine session are built on first use and kept. ``forward`` maps args and kwargs through
the recorded call signature (``_signature``), runs the session under ``torch.no_grad`` and
returns torch tensors in the traced output structure.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable
from typing import Any

import onnx
import torch
from torch import nn

from ..onnx import float_to_onnx, openvino_layout, to_onnx
from ..onnx._load import parse_onnx
from ..onnx.exporter._export import TARGETS
from ..torch import QuantModel, float_mode
from ..torch._batches import inputs_from_spec
from ..torch._model import FLOAT_SWITCHES, check_dynamic
from ._backends import check_options, engine_name, make_session, normalized_options
from ._signature import CallSignature

QUANTIZED, FLOAT = True, False
_QUANTIZED_OPS = {
    "QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger",
    "MatMulInteger", "DynamicQuantizeLinear", "QLinearAdd", "QLinearMul",
}  # fmt: skip
TRAIN_MESSAGE = "engine models are inference-only; train the QuantModel"


def is_quantized(model: onnx.ModelProto) -> bool:
    """Whether the graph computes with quantized tensors (Q/DQ pairs or integer operators)."""
    return any(node.op_type in _QUANTIZED_OPS for node in model.graph.node)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1024 or unit == "MB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class EngineModel(nn.Module):
    """An ONNX graph run by an engine, called like the model it was exported from.

    ``forms`` maps ``QUANTIZED``/``FLOAT`` to serialized ONNX bytes, or to a function making them
    (built on first use). ``quantized`` picks the form used now; ``set_quantization`` and
    ``quantbridge.float_mode`` switch it.
    """

    def __init__(
        self,
        forms: dict[bool, bytes | Callable[[], bytes]],
        engine: str,
        threads: int | None = None,
        options: dict | None = None,
        quantized: bool = True,
        source_class: str = "",
        layout: str | None = None,
    ):
        super().__init__()
        self.training = False
        self.engine = engine_name(engine)
        self.threads = threads
        check_options(self.engine, dict(options or {}))
        self.options = normalized_options(self.engine, options or {})
        self.source_class = source_class
        self.layout = layout  # of the quantized form (``TARGETS``); None: an ONNX file as stored
        self._forms = dict(forms)
        self._sessions: dict[bool, Any] = {}
        self._signatures: dict[bool, CallSignature] = {}
        self.quantized = quantized if quantized in self._forms else next(iter(self._forms))
        self._signature()  # the current form is read (and checked) now

    # -- forms and sessions -----------------------------------------------------------------------
    @property
    def forms(self) -> list[str]:
        """The precisions this model can run: ``"int8"`` (quantized) and/or ``"fp32"``."""
        return [_precision(q) for q in (QUANTIZED, FLOAT) if q in self._forms]

    def onnx_bytes(self, quantized: bool | None = None) -> bytes:
        """The serialized ONNX model of a form (the current one by default), made if needed."""
        key = self.quantized if quantized is None else bool(quantized)
        if key not in self._forms:
            raise ValueError(self._no_form(key))
        form = self._forms[key]
        if callable(form):
            form = self._forms[key] = form()
        return form

    def _signature(self) -> CallSignature:
        sig = self._signatures.get(self.quantized)
        if sig is None:
            model = onnx.load_from_string(self.onnx_bytes())
            sig = self._signatures[self.quantized] = CallSignature(model)
        return sig

    def _session(self):
        session = self._sessions.get(self.quantized)
        if session is None:
            session = make_session(self.engine, self.onnx_bytes(), self.threads, self.options)
            self._sessions[self.quantized] = session
        return session

    def _no_form(self, quantized: bool) -> str:
        if quantized:
            return (
                f"this engine model runs a float {self.source_class or 'model'} and has no "
                "quantized form; quantize it first (qb.quantize) and pass the QuantModel to "
                "qb.to_engine"
            )
        return (
            "this engine model was made from an ONNX graph and has no float form; make it from "
            "the QuantModel (qb.to_engine(qmodel, ...); for a QDQ file qb.import_onnx gives one)"
        )

    # -- the switch -----------------------------------------------------------------------------
    def set_quantization(self, enabled: bool) -> None:
        """Run the quantized form (True) or the fp32 export of the same weights (False)."""
        if bool(enabled) not in self._forms:
            raise ValueError(self._no_form(bool(enabled)))
        self.quantized = bool(enabled)

    @property
    def quantization_enabled(self) -> bool:
        return self.quantized

    @property
    def precision(self) -> str:
        return _precision(self.quantized)

    # -- calling --------------------------------------------------------------------------------
    def forward(self, *args, **kwargs) -> Any:
        sig, session = self._signature(), self._session()
        with torch.no_grad():
            feeds = sig.feeds(args, kwargs)
            arrays = session.run(feeds)
        return sig.outputs(arrays, _device(args, kwargs))

    def train(self, mode: bool = True) -> EngineModel:
        if mode:
            raise RuntimeError(TRAIN_MESSAGE)
        self.training = False
        return self

    # -- the raw model --------------------------------------------------------------------------
    @property
    def onnx_model(self) -> onnx.ModelProto:
        """The ``onnx.ModelProto`` of the current form (a fresh copy; edits do not reach the
        engine)."""
        return onnx.load_from_string(self.onnx_bytes())

    @property
    def signature(self) -> str:
        """How to call it: ``forward(x: float32[batch, 3, 224, 224])``."""
        return self._signature().describe()

    def save_onnx(self, path: str | os.PathLike) -> None:
        """Write the current form as an ONNX file."""
        with open(os.fspath(path), "wb") as f:
            f.write(self.onnx_bytes())

    def extra_repr(self) -> str:
        size = _size(len(self.onnx_bytes()))
        layout = f", layout={self.layout}" if self.layout and self.quantized else ""
        return (
            f"engine={self.engine}, precision={self.precision}, {self.signature}, "
            f"file={size}, forms={'/'.join(self.forms)}{layout}"
        )


def _precision(quantized: bool) -> str:
    return "int8" if quantized else "fp32"


def _device(args: tuple, kwargs: dict) -> torch.device | None:
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            return x.device
    return None


def _quantmodel_forms(qmodel: QuantModel, example: Any, export: dict, layout: str) -> dict:
    with warnings.catch_warnings():  # torch's own GraphModule copy uses a deprecated pytree API
        warnings.filterwarnings("ignore", r".*LeafSpec.* is deprecated", FutureWarning)
        snapshot = copy.deepcopy(qmodel)  # the float form is made later from these weights
    proto = to_onnx(snapshot, example, **export)
    if layout == "openvino" and any(n.op_type == "QuantizeLinear" for n in proto.graph.node):
        proto = openvino_layout(proto)  # (a QuantModel with nothing quantized has no pair)
    quantized = proto.SerializeToString()

    def float_form() -> bytes:
        with float_mode(snapshot), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # int8 performance advice does not apply to fp32
            return to_onnx(snapshot, example, **export).SerializeToString()

    return {QUANTIZED: quantized, FLOAT: float_form}


def _example(model: nn.Module, example_inputs: Any) -> Any:
    if example_inputs is not None:
        return example_inputs
    capture = getattr(model, "qb_capture", None) if isinstance(model, QuantModel) else None
    if capture and "inputs" in capture:
        args, kwargs = inputs_from_spec(capture["inputs"])
        if kwargs and not args:
            return kwargs
        if not kwargs:
            return args
    raise TypeError(
        f"qb.to_engine needs example_inputs= for a {type(model).__name__}: a tensor, a tuple of "
        "positional inputs or a dict of keyword inputs, as in a call of the model"
    )


def to_engine(
    model: nn.Module | str | os.PathLike | onnx.ModelProto,
    engine: str = "onnxruntime",
    example_inputs: Any = None,
    threads: int | None = None,
    *,
    dynamic: str | None = None,
    opset: int | None = None,
    layout: str | None = None,
    **options: Any,
) -> EngineModel:
    """``model`` as an ``EngineModel`` on ``engine`` (see the module docstring).

    ``dynamic`` and ``opset`` are those of ``quantbridge.export``; ``dynamic`` defaults to the
    QuantModel's capture (``"batch"`` otherwise). ``layout``: the quantized form's layout, one of
    ``TARGETS`` (default: the engine's own; module docstring). ``options`` go to the engine
    (``quantbridge.engine._backends`` lists them).
    """
    engine = engine_name(engine)
    _check_layout(engine, layout, model)
    check_options(engine, options)  # before the export: a typo should not cost a trace
    options = normalized_options(engine, options)
    check_dynamic(model, dynamic, "to_engine")  # before the export: it costs a trace
    captured = (model.qb_capture or {}).get("dynamic") if isinstance(model, QuantModel) else None
    if dynamic is None:
        dynamic = captured or "batch"
    export = {"dynamic": dynamic, "opset": opset}
    if isinstance(model, QuantModel):
        layout = layout or ("openvino" if engine == "openvino" else "onnxruntime")
        forms = _quantmodel_forms(model, _example(model, example_inputs), export, layout)
        source = model.__dict__.get("_qb_source")
        source = model if source is None else source
    elif isinstance(model, nn.Module):
        if isinstance(model, EngineModel):
            raise TypeError("this is already an engine model; pass the QuantModel it came from")
        example = _example(model, example_inputs)
        forms = {FLOAT: float_to_onnx(model, example, **export).SerializeToString()}
        source = model
    elif isinstance(model, (str, os.PathLike, onnx.ModelProto)):
        proto = model if isinstance(model, onnx.ModelProto) else _read_onnx(model)
        if layout == "openvino":
            proto = openvino_layout(proto)  # ValueError naming the fix for a float file
        forms = {is_quantized(proto): proto.SerializeToString()}
        source = None
    else:
        raise TypeError(
            f"qb.to_engine takes a QuantModel, a torch model or an ONNX file, got a "
            f"{type(model).__name__}"
        )
    source_class = "" if source is None else type(source).__qualname__
    return EngineModel(forms, engine, threads, options, QUANTIZED, source_class, layout)


def _check_layout(engine: str, layout: str | None, model: Any) -> None:
    """ValueError for a layout that is not one of ``TARGETS``, one the integer program cannot
    lower, or one asked of a float torch model (which has no Q/DQ to lay out)."""
    if layout is None:
        return
    if layout not in TARGETS:
        raise ValueError(
            f"to_engine: layout={layout!r} is not a known layout; use one of {', '.join(TARGETS)}"
            " (default: the engine's own)"
        )
    if engine == "integer" and layout != "onnxruntime":
        raise ValueError(
            f"to_engine: the integer program lowers the canonical QDQ layout, not {layout!r} "
            "(which leaves element-wise ops in float); leave layout unset"
        )
    if isinstance(model, nn.Module) and not isinstance(model, QuantModel):
        raise ValueError(
            f"to_engine: layout={layout!r} lays out a quantized model's Q/DQ pairs; a float "
            f"{type(model).__name__} has none (quantize it first, or leave layout unset)"
        )


def _read_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no ONNX file at {path!r}")
    # one wording with every other reader: not ONNX, truncated, external data not next to it
    return parse_onnx(lambda: onnx.load(path), repr(path), "to_engine")


FLOAT_SWITCHES.append(EngineModel)
