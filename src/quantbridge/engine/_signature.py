"""Calls of the user's model mapped onto an ONNX graph's inputs, and its outputs rebuilt.

``CallSignature(model)`` reads the call record the exporter wrote into the file
(``quantbridge.onnx.exporter._signature``: the traced ``forward``'s parameters, the pytree specs
of the call and of the output, which input leaf is which graph input). Then

* ``feeds(args, kwargs)`` binds a call by name as Python would (positional or keyword), puts it in
  the layout of the traced call, flattens it and checks every leaf: a tensor against its graph
  input (dtype, rank, every fixed dimension), a plain value against the constant the trace baked
  in. Any mismatch is one ``ValueError``/``TypeError`` line that names the expected signature,
  never the engine's own message;
* ``outputs(arrays)`` turns the engine's arrays into torch tensors (sharing memory) and rebuilds
  the traced structure: a tensor, a tuple, a dict, a Hugging Face ``ModelOutput``.

A file without the record (not written by quantbridge) is called by its graph input names, in
graph order, and returns one tensor or a tuple.
"""

from __future__ import annotations

import importlib
import inspect
import json
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper
from torch.utils import _pytree as pytree

from ..onnx.exporter import SIGNATURE_KEY
from ..torch._positional import to_capture_layout

_KINDS = {kind.name: kind for kind in type(inspect.Parameter.POSITIONAL_ONLY)}
_UNSET = object()
# packages whose output types may be imported to rebuild a recorded structure
_OUTPUT_PACKAGES = ("transformers",)


class GraphInput:
    """One graph input: name, numpy dtype and dims (int fixed, str symbolic, None unknown)."""

    def __init__(self, value: onnx.ValueInfoProto):
        tensor = value.type.tensor_type
        self.name = value.name
        self.dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type))
        self.dims: list[int | str | None] = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor.shape.dim
        ]
        try:
            self.torch_dtype: torch.dtype | None = torch.from_numpy(np.empty(0, self.dtype)).dtype
        except TypeError:  # a string input: no torch tensor can feed it
            self.torch_dtype = None

    def describe(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.dims)
        return f"{self.dtype.name}[{dims}]"


def _describe_value(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}"
    return repr(x) if x is None or isinstance(x, (bool, int, float, str)) else type(x).__name__


def _render(x: Any) -> str:
    if isinstance(x, tuple):
        return "(" + ", ".join(_render(v) for v in x) + ("," if len(x) == 1 else "") + ")"
    if isinstance(x, list):
        return "[" + ", ".join(_render(v) for v in x) + "]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_render(v)}" for k, v in x.items()) + "}"
    return str(x)


def _load_spec(text: str) -> pytree.TreeSpec:
    """``treespec_loads``; a type from an allowed package that is not registered yet has its
    module imported: Hugging Face registers each ``ModelOutput`` class with pytree when the class
    is defined, and ``import transformers`` is lazy (``transformers.modeling_outputs``, or a
    model's own ``transformers.models.mamba.modeling_mamba``, is what defines them)."""
    try:
        return pytree.treespec_loads(text)
    except Exception as first:  # noqa: BLE001 - the type may simply not be registered yet
        types = _types(json.loads(text)[1])
        wanted = sorted(
            {t.rpartition(".")[0] for t in types if t.split(".")[0] in _OUTPUT_PACKAGES}
        )
        if not wanted:
            raise ValueError(
                f"the model's recorded output structure uses types {sorted(types)} that are not "
                "registered with torch.utils._pytree; import the module that defines them first"
            ) from first
        for module in wanted:
            importlib.import_module(module)
        return pytree.treespec_loads(text)


def _types(node: dict) -> set[str]:
    found = {node["type"]} if node.get("type") else set()
    for child in node.get("children_spec", []):
        found |= _types(child)
    return found


class CallSignature:
    """See the module docstring."""

    def __init__(self, model: onnx.ModelProto):
        initializers = {i.name for i in model.graph.initializer}
        self.inputs = [GraphInput(v) for v in model.graph.input if v.name not in initializers]
        self.n_outputs = len(model.graph.output)
        by_name = {i.name: i for i in self.inputs}
        meta = {p.key: p.value for p in model.metadata_props}
        record = json.loads(meta[SIGNATURE_KEY]) if SIGNATURE_KEY in meta else None
        if record is None:  # a foreign file: graph inputs by name, in graph order
            self.parameters = [(i.name, "POSITIONAL_OR_KEYWORD") for i in self.inputs]
            self.in_spec = self.out_spec = None
            self.leaves: list[dict] = [{"input": i.name} for i in self.inputs]
            self.out_leaves = [{"output": k} for k in range(self.n_outputs)]
        else:
            self.parameters = [tuple(p) for p in record["parameters"]]
            self.in_spec = pytree.treespec_loads(record["in_spec"])
            self.out_spec = _load_spec(record["out_spec"])
            self.leaves, self.out_leaves = record["inputs"], record["outputs"]
        self.forward = None if record is None else record.get("forward")
        missing = [e["input"] for e in self.leaves if "input" in e and e["input"] not in by_name]
        if missing:
            raise ValueError(f"the ONNX graph has no input {missing[0]!r} named in its signature")
        self._by_name = by_name
        self._signature = inspect.Signature(
            [
                # *args / **kwargs take no default (Python refuses one: a float HF BertModel's
                # ``forward(..., **kwargs)`` could not be put behind an engine)
                inspect.Parameter(
                    name, _KINDS[kind], default=inspect.Parameter.empty if "VAR" in kind else _UNSET
                )
                for name, kind in self.parameters
            ]
        )
        self._variadic = any(k in ("VAR_POSITIONAL", "VAR_KEYWORD") for _, k in self.parameters)

    # -- the call layout of the trace ------------------------------------------------------------
    def _layout(self) -> tuple[int, list[str]]:
        """(number of positional args, kwargs names) of the traced call."""
        if self.in_spec is None:
            return len(self.inputs), []
        spec = self.in_spec
        args_spec, kwargs_spec = (
            spec.children() if hasattr(spec, "children") else spec.children_specs
        )
        return args_spec.num_children, list(kwargs_spec.context)

    def describe(self) -> str:
        """``forward(x: float32[batch, 3, 32, 32], mask: float32[batch, 8], scale: 2.0)``."""
        leaves = []
        for e in self.leaves:
            if "input" in e:
                leaves.append(self._by_name[e["input"]].describe())
            else:
                leaves.append(repr(e["constant"]) if "constant" in e else e["constant_repr"])
        if self.in_spec is None:
            parts = [f"{i.name}: {d}" for i, d in zip(self.inputs, leaves, strict=True)]
            return f"forward({', '.join(parts)})"
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        names = [n for n, k in self.parameters if k in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
        parts = [
            f"{names[i] if i < len(names) else f'arg{i}'}: {_render(a)}" for i, a in enumerate(args)
        ]
        if self.forward:  # keyword inputs in the user's forward order, not the batch dict's
            rank = {p[0]: i for i, p in enumerate(self.forward)}
            kwargs = dict(sorted(kwargs.items(), key=lambda kv: rank.get(kv[0], len(rank))))
        parts += [f"{k}: {_render(v)}" for k, v in kwargs.items()]
        return f"forward({', '.join(parts)})"

    def _error(self, what: str, cls: type[Exception] = ValueError) -> Exception:
        return cls(f"{what}; this engine model is called as {self.describe()}")

    def _bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call in the traced layout (positional count and keyword names of the trace)."""
        n_args, names = self._layout()
        if self.forward and args:  # positional inputs of a keyword capture: the user's order
            try:
                mapped = to_capture_layout(self.forward, n_args, names, tuple(args), kwargs)
            except TypeError as e:
                raise self._error(str(e), TypeError) from None
            if mapped is not None:
                args, kwargs = mapped
        if self._variadic:  # *args/**kwargs forward: the call must look like the trace
            if len(args) != n_args or set(kwargs) != set(names):
                raise self._error(
                    f"got {len(args)} positional and keywords {sorted(kwargs)}", TypeError
                )
            return tuple(args), {k: kwargs[k] for k in names}
        try:
            bound = self._signature.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise self._error(f"bad call: {e}", TypeError) from None
        given = {k for k, v in bound.items() if v is not _UNSET}
        order = [n for n, _ in self.parameters]
        wanted = order[:n_args] + names
        lacking = [n for n in wanted if n not in given]
        if lacking:
            raise self._error(f"missing input {lacking[0]!r}{self._baked(lacking[0])}", TypeError)
        extra = sorted(given - set(wanted))
        if extra:
            raise self._error(
                f"input {extra[0]!r} was not part of the exported call (export with it to use it)",
                TypeError,
            )
        return tuple(bound[n] for n in order[:n_args]), {k: bound[k] for k in names}

    def _baked(self, name: str) -> str:
        """For a parameter the export took as a plain value (``use_cache=False``), the hint to
        pass that value; else ''."""
        if self.in_spec is None:
            return ""
        args, kwargs = pytree.tree_unflatten(self.leaves, self.in_spec)
        order = [n for n, _ in self.parameters]
        entry = kwargs.get(name)
        if entry is None and name in order and order.index(name) < len(args):
            entry = args[order.index(name)]
        if isinstance(entry, dict) and "constant" in entry:
            return f" (the export baked in {name}={entry['constant']!r}: pass that value)"
        return ""

    # -- inputs ---------------------------------------------------------------------------------
    def feeds(self, args: tuple, kwargs: dict) -> dict[str, np.ndarray]:
        """Graph input name -> array for the call ``(args, kwargs)`` (checked; see the module)."""
        args, kwargs = self._bind(args, kwargs)
        if self.in_spec is None:
            flat = list(args) + list(kwargs.values())
        else:
            flat, spec = pytree.tree_flatten((args, kwargs))
            if spec != self.in_spec or len(flat) != len(self.leaves):
                got = _render(pytree.tree_map(_describe_value, (args, kwargs)))
                raise self._error(f"the inputs' structure {got} differs from the export's")
        feeds = {}
        for value, entry in zip(flat, self.leaves, strict=True):
            if "input" in entry:
                graph_input = self._by_name[entry["input"]]
                feeds[graph_input.name] = self._array(graph_input, value)
            elif "constant" in entry and value != entry["constant"]:
                raise self._error(
                    f"got {value!r} where the export baked in {entry['constant']!r} (plain "
                    "values are constants of the graph; export again to change them)"
                )
        return feeds

    def _array(self, graph_input: GraphInput, value: Any) -> np.ndarray:
        name = graph_input.name
        if not isinstance(value, torch.Tensor):
            raise self._error(
                f"input {name!r} is a {type(value).__name__}; expected a torch.Tensor "
                f"{graph_input.describe()}",
                TypeError,
            )
        # dtype and device are checked on the tensor: numpy has no bfloat16 and a meta tensor no
        # data, and torch's own errors for them name neither the input nor the fix
        if value.dtype != graph_input.torch_dtype:
            raise self._error(
                f"input {name!r} is {_describe_value(value)}; expected "
                f"{graph_input.describe()} (convert it with .to(torch.{graph_input.dtype.name}))",
                TypeError,
            )
        if value.device.type == "meta":
            raise self._error(f"input {name!r} is on the meta device (no data); pass real values")
        array = value.detach()
        if array.device.type != "cpu":
            array = array.cpu()
        array = array.numpy(force=False) if array.is_contiguous() else array.contiguous().numpy()
        dims = graph_input.dims
        fixed_ok = all(
            not isinstance(d, int) or d == n for d, n in zip(dims, array.shape, strict=False)
        )
        if array.ndim != len(dims) or not fixed_ok:
            fix = ""
            shape = zip(dims, array.shape, strict=False)
            wrong = [k for k, (d, n) in enumerate(shape) if isinstance(d, int) and d != n]
            if array.ndim == len(dims) and wrong == [0]:
                fix = (  # the batch size is the export's choice, not the model's
                    " (the export fixed the batch size: quantize with dynamic='batch', or "
                    "export the file with a dynamic batch axis, to vary it)"
                )
            elif array.ndim == len(dims) and wrong:  # a sequence length, an image size
                fix = (
                    f" (the export fixed dimension {wrong[0]} at {dims[wrong[0]]}: quantize with "
                    "dynamic='all' and make the engine model again, or export the file with that "
                    "axis dynamic, to vary it)"
                )
            raise self._error(
                f"input {name!r} has shape {list(array.shape)}; expected "
                f"{graph_input.describe()}{fix}"
            )
        return array

    def call_of(self, feeds: dict[str, Any]) -> tuple[tuple, dict]:
        """The torch call ``(args, kwargs)`` that ``feeds`` came from (the inverse of ``feeds``):
        each graph input's array as a tensor, each plain value as the export baked it in (a
        foreign file: the arrays positionally, in graph order)."""
        leaves: list[Any] = []
        for e in self.leaves:
            if "input" in e:
                leaves.append(torch.as_tensor(np.asarray(feeds[e["input"]])))
            elif "constant" in e:
                leaves.append(e["constant"])
            else:
                raise ValueError(
                    f"the export baked in {e['constant_repr']}, which cannot be rebuilt from "
                    "arrays; call the torch model itself"
                )
        if self.in_spec is None:
            return tuple(leaves), {}
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        return tuple(args), dict(kwargs)

    # -- outputs --------------------------------------------------------------------------------
    def outputs(self, arrays: list[np.ndarray], device: torch.device | None = None) -> Any:
        """The engine's arrays as torch tensors in the traced output structure."""
        if len(arrays) != self.n_outputs:
            raise RuntimeError(f"the engine returned {len(arrays)} outputs, not {self.n_outputs}")
        tensors = [torch.from_numpy(a) for a in arrays]
        if device is not None and device.type != "cpu":
            tensors = [t.to(device) for t in tensors]
        leaves = [
            tensors[e["output"]] if "output" in e else e.get("constant") for e in self.out_leaves
        ]
        if self.out_spec is None:
            return leaves[0] if len(leaves) == 1 else tuple(leaves)
        return pytree.tree_unflatten(leaves, self.out_spec)

    def input_names(self) -> list[str]:
        return [i.name for i in self.inputs]
