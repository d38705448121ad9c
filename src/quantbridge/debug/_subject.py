"""What ``compare`` was given, normalised: a model in the forms quantbridge can run, and the
inputs checked against it.

A ``Subject`` is one model argument: an ONNX path or ``ModelProto`` (QDQ, QOperator or float),
a ``QuantModel`` (exported to QDQ in memory, so the ONNX engines run the same model), or a float
torch module. ``feeds`` turns the user's inputs (a dict name -> array, an ``.npz`` path, one
array or a tuple of arrays) into ONNX feeds, with errors that name the expected inputs and
shapes.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch

from ..onnx import to_onnx
from ..onnx._qonnx import qonnx_to_qcdq
from ..optables import GROUP_WISE_OPS, INTEGER_OPS
from ..torch import QuantModel
from ._match import has_weight_only_weights

PLAIN_VALUES = (bool, int, float, str, type(None))  # a call's non-tensor values, as Python types
_ELEM = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64}


@dataclass
class Subject:
    """One model to compare: its ONNX form (if any), its torch form (if any), a label."""

    label: str
    onnx: onnx.ModelProto | None = None
    form: str = ""  # 'qdq' | 'qop' | 'float' (the ONNX file's form) | '' (no ONNX)
    torch: torch.nn.Module | None = None
    tag: str = "a"  # 'a' or 'b': the argument it came from (prefixes run names of two models)
    # a float ONNX file beside a quantized one: site -> (its float tensor, the rule that paired
    # them), from ``_match_float.match_float_file``
    float_pairs: dict[str, tuple[str, str]] | None = None

    @property
    def quantized(self) -> bool:
        return self.form in ("qdq", "qop")


def onnx_form(model: onnx.ModelProto) -> str:
    """'qop' when the graph has integer operators (or ONNX Runtime's ``MatMulNBits`` /
    ``GatherBlockQuantized``), 'qdq' with QuantizeLinear or weight-only quantized weights (a
    blocked DequantizeLinear, or NNCF's integer weights read by DequantizeLinear), else 'float'."""
    ops = {n.op_type for n in model.graph.node}
    if ops & INTEGER_OPS or any(op.startswith("QLinear") for op in ops) or ops & GROUP_WISE_OPS:
        return "qop"
    return "qdq" if "QuantizeLinear" in ops or has_weight_only_weights(model) else "float"


def _load_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{os.fspath(path)}: no such file")
    try:
        model = onnx.load(os.fspath(path))
    except Exception as e:  # protobuf's DecodeError and friends
        raise ValueError(f"{os.fspath(path)}: not an ONNX model ({type(e).__name__})") from None
    if not model.HasField("graph"):
        raise ValueError(f"{os.fspath(path)}: not an ONNX model (no graph)")
    return qonnx_to_qcdq(model)  # QONNX's Quant (Brevitas, FINN): ONNX Runtime runs its QCDQ form


def load_subject(model: Any, label: str, inputs: Any) -> Subject:
    """``model`` as a Subject; a QuantModel is exported with ``inputs`` as example inputs."""
    if isinstance(model, (str, os.PathLike)):
        proto = _load_onnx(model)
        return Subject(os.fspath(model), proto, onnx_form(proto), tag=label)
    if isinstance(model, onnx.ModelProto):
        return Subject(model.graph.name or label, model, onnx_form(model), tag=label)
    if isinstance(model, QuantModel):
        proto = to_onnx(model, _quantmodel_call(model, inputs))
        return Subject(type(model).__name__, proto, "qdq", model, tag=label)
    if isinstance(model, torch.nn.Module):
        return Subject(type(model).__name__, torch=model, tag=label)
    raise TypeError(
        f"compare takes ONNX paths, onnx.ModelProto, QuantModel or torch.nn.Module; got "
        f"{type(model).__name__}"
    )


def _quantmodel_call(model: QuantModel, inputs: Any) -> Any:
    """The example call a QuantModel is exported with: a dict of inputs as the keywords it was
    captured with (a plain value the capture saw, GPT-2's ``use_cache=False``, filled in when the
    inputs lack it), or positionally in its ``forward``'s order; arrays become tensors."""
    spec = (getattr(model, "qb_capture", None) or {}).get("inputs")
    if not isinstance(inputs, Mapping) or spec is None:
        return torch_args(inputs, None)
    if not spec["kwargs"]:  # captured positionally: the dict in the forward's parameter order
        names = list(inspect.signature(model.forward).parameters)[: len(spec["args"])]
        return torch_args(inputs, names if set(names) <= set(inputs) else None)
    call = {k: _as_torch(v) for k, v in inputs.items()}
    for name, entry in spec["kwargs"].items():
        if name not in call and "value" in entry:
            call[name] = entry["value"]
    return {k: call[k] for k in [*spec["kwargs"], *call] if k in call}


def _as_torch(x: Any) -> Any:
    return x if type(x) in PLAIN_VALUES else torch.as_tensor(np.asarray(x))


def array_inputs(inputs: Any) -> Any:
    """``inputs`` without the plain values of a call (``use_cache=False``): those are constants of
    an exported graph, not arrays to feed it."""
    if isinstance(inputs, Mapping):
        return {k: v for k, v in inputs.items() if type(v) not in PLAIN_VALUES}
    return inputs


def read_inputs(inputs: Any) -> Any:
    """An ``.npz`` path read into a dict; anything else as given (None refused, with the forms)."""
    if inputs is None:
        raise TypeError(
            "inputs is None: pass the inputs to run, as a tensor or array, a tuple of them, a dict "
            "{input name: array} or an .npz path, e.g. compare(qmodel, inputs=x)"
        )
    if isinstance(inputs, (str, os.PathLike)):
        if not os.path.isfile(inputs):
            raise FileNotFoundError(f"inputs {os.fspath(inputs)}: no such file")
        with np.load(os.fspath(inputs)) as data:
            return {k: data[k] for k in data.files}
    return inputs


def torch_args(inputs: Any, names: list[str] | None) -> tuple:
    """Positional torch tensors for a torch model (dict inputs in graph-input order)."""
    if isinstance(inputs, Mapping):
        keys = names if names is not None else list(inputs)
        return tuple(torch.as_tensor(np.asarray(inputs[k])) for k in keys)
    if isinstance(inputs, (tuple, list)):
        return tuple(torch.as_tensor(np.asarray(x)) for x in inputs)
    return (torch.as_tensor(np.asarray(inputs)),)


def feeds(model: onnx.ModelProto, inputs: Any, label: str) -> dict[str, np.ndarray]:
    """ONNX feeds for ``model``: ValueError naming the expected inputs when the names do not
    match, and the declared shape when a static dimension differs."""
    init = {i.name for i in model.graph.initializer}
    graph_inputs = [v for v in model.graph.input if v.name not in init]
    expected = [v.name for v in graph_inputs]
    if not isinstance(inputs, Mapping):
        arrays = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
        if len(arrays) != len(expected):
            raise ValueError(
                f"{label}: {len(arrays)} input arrays for a model with inputs {expected}; pass a "
                "dict (or an .npz file) keyed by these names"
            )
        inputs = dict(zip(expected, arrays, strict=True))
    unknown = sorted(set(inputs) - set(expected))
    missing = [n for n in expected if n not in inputs]
    if unknown or missing:
        raise ValueError(
            f"{label}: inputs {sorted(inputs)} do not match the model's inputs {expected} "
            f"(missing {missing}, unknown {unknown}); key the arrays by the model's input names"
        )
    out = {}
    for v in graph_inputs:
        x = np.asarray(inputs[v.name])
        dims = v.type.tensor_type.shape.dim
        # a negative dim_value is a dynamic size (Paddle's exporter writes -1 for the batch;
        # ONNX Runtime runs any size there), like a dim_param
        declared = tuple(
            d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None for d in dims
        )
        if len(declared) != x.ndim or any(
            d is not None and d != s for d, s in zip(declared, x.shape, strict=False)
        ):
            shown = tuple(d if d is not None else "?" for d in declared)
            raise ValueError(
                f"{label}: input {v.name!r} has shape {x.shape}; the model expects {shown} "
                "('?' = any size)"
            )
        dtype = _ELEM.get(v.type.tensor_type.elem_type)
        out[v.name] = x.astype(dtype) if dtype is not None else x
    return out
