"""Pickling a ``QuantModel``: ``torch.save(qmodel)`` / ``torch.load(..., weights_only=False)``,
``pickle``, ``multiprocessing``.

``torch.fx`` pickles a ``GraphModule`` as its generated code and traces that code again on load.
For a ``QuantModel`` that fails or loses what the library reads later, so ``QuantModel.__reduce__``
hands the model to ``reduce_quant_model``, which pickles

* the graph itself, node by node (op, name, target, arguments, metadata) with its code generator
  (the call's pytree structure): the same node names, the same generated code, no re-trace.
  Operator overloads (``aten.conv2d.default``) are pickled by name;
* each node's captured value (``meta["val"]``: fake tensors whose sizes may be symbolic, ``s31``)
  as sizes, strides and dtype, the symbols as sympy expressions with their ranges; ``load`` makes
  them again in one fresh ``FakeTensorMode`` (a ``ShapeEnv`` that knows the same symbols and
  ranges), so the input checks (``_signature.check_call``), debug tools (``nn_module_stack``) and
  the one-trace export (``onnx.exporter._reuse``) work on the loaded model as on the original.
  Metadata entries that cannot be pickled otherwise are left out;
* every instance attribute as it is (user parameters, quantizers and their state, recipe,
  placement record, hooks, the source model), except the capture's input-guard module
  ``_guards_fn``: its forward is code torch generated at capture and cannot be pickled. It becomes
  an ``InputGuards`` with the same checks as data: every size the capture fixed, every dynamic
  size inside its range, a symbol shared by two inputs the same size in both.

Hook ids are kept as they were, as ``nn.Module`` pickling keeps them. The pickle refers to
quantbridge's and torch's classes by name: load it with the same versions (``qb.save`` /
``qb.load`` is the format meant to last).
"""

from __future__ import annotations

import math
import pickle
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree

if TYPE_CHECKING:  # sympy and torch's symbolic shapes load when a pickle is read (0.3-0.4 s)
    import sympy
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

_GUARDS = "_guards_fn"  # torch.export's input-guard submodule of a captured graph
_DERIVED = ("_graph", "_code", "_lineno_map", "_prologue_start", "_in_spec", "_out_spec")


def reduce_quant_model(model: torch.fx.GraphModule, cls: type) -> tuple:
    """``model.__reduce__()``: ``(rebuild_quant_model, (cls, state, graph record))``."""
    ranges: dict[sympy.Symbol, tuple] = {}
    state = {k: v for k, v in model.__dict__.items() if k not in _DERIVED}
    modules = dict(state["_modules"])
    guards = modules.get(_GUARDS)
    if guards is not None and not isinstance(guards, InputGuards):
        modules[_GUARDS] = InputGuards.of_graph(model.graph, ranges)
    state["_modules"] = modules
    return rebuild_quant_model, (cls, state, _graph_record(model.graph, ranges), ranges)


def rebuild_quant_model(cls: type, state: dict, record: dict, ranges: dict) -> nn.Module:
    """The model ``reduce_quant_model`` pickled: its graph rebuilt with fake values, then
    ``cls.__init__(root, graph)`` as ``GraphModule.__deepcopy__`` does, then every attribute
    restored as it was."""
    graph = _graph_from(record, _fake_mode(ranges))
    root = nn.Module()
    root.__dict__.update(state)
    model = cls.__new__(cls)
    cls.__init__(model, root, graph)
    model.__dict__.update(state)
    return model


# -- the graph ------------------------------------------------------------------------------------
def _graph_record(graph: torch.fx.Graph, ranges: dict) -> dict:
    nodes = []
    for node in graph.nodes:
        nodes.append(
            {
                "op": node.op,
                "name": node.name,
                "target": _target(node.target),
                "args": _names(node.args),
                "kwargs": _names(node.kwargs),
                "type": node.type,
                "meta": _meta(node.meta, ranges),
            }
        )
    return {
        "nodes": nodes,
        "codegen": _codegen_record(graph._codegen),
        "tracer": getattr(graph, "_tracer_cls", None),
    }


def _graph_from(record: dict, mode: FakeTensorMode) -> torch.fx.Graph:
    graph = torch.fx.Graph(tracer_cls=record["tracer"])
    graph._codegen = _codegen_from(record["codegen"])
    made: dict[str, torch.fx.Node] = {}
    for r in record["nodes"]:
        args = _nodes(r["args"], made)
        kwargs = _nodes(r["kwargs"], made)
        node = graph.create_node(r["op"], _op(r["target"]), args, kwargs, r["name"], r["type"])
        if node.name != r["name"]:
            raise pickle.UnpicklingError(f"node {r['name']!r} came back as {node.name!r}")
        node.meta = {k: _decode(v, mode) for k, v in r["meta"].items()}
        made[node.name] = node
    return graph


def _codegen_record(codegen: torch.fx.graph.CodeGen) -> Any:
    """A pytree code generator with its call structure as pytree's JSON (unpickling a
    ``TreeSpec`` warns that ``LeafSpec`` is deprecated); any other as it is."""
    info = getattr(codegen, "pytree_info", None)
    if type(codegen) is not _PyTreeCodeGen or info is None:
        return codegen
    try:
        specs = [None if s is None else pytree.treespec_dumps(s) for s in info[1:]]
    except Exception:  # noqa: BLE001 - a node type pytree cannot write: pickle it as it is
        return codegen
    return _PyTreeRecord((list(info.orig_args), *specs))


def _codegen_from(record: Any) -> torch.fx.graph.CodeGen:
    if not isinstance(record, _PyTreeRecord):
        return record
    args, in_spec, out_spec = record
    specs = [None if s is None else pytree.treespec_loads(s) for s in (in_spec, out_spec)]
    return _PyTreeCodeGen(_PyTreeInfo(args, *specs))


class _PyTreeRecord(tuple):
    """A ``_PyTreeCodeGen`` in a record: (argument names, in spec, out spec as JSON)."""


class _NodeName(str):
    """A node argument in a record: the name of the node it refers to."""


class _OpName(tuple):
    """An operator overload in a record: (namespace, name, overload)."""


def _target(target: Any) -> Any:
    if isinstance(target, torch._ops.OpOverload):
        return _OpName((target.namespace, target._opname, target._overloadname))
    return target


def _op(target: Any) -> Any:
    if isinstance(target, _OpName):
        namespace, name, overload = target
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    return target


def _names(value: Any) -> Any:
    def name(v: Any) -> Any:
        return _NodeName(v.name) if isinstance(v, torch.fx.Node) else _target(v)

    return torch.fx.node.map_aggregate(value, name)


def _nodes(value: Any, made: dict[str, torch.fx.Node]) -> Any:
    def node(v: Any) -> Any:
        if isinstance(v, _NodeName):
            return made[str(v)]
        return _op(v)

    return torch.fx.node.map_aggregate(value, node)


# -- metadata: fake values as data ----------------------------------------------------------------
class _Fake(tuple):
    """A fake tensor: (sizes, strides, storage offset, dtype, device, requires_grad)."""


class _Sym(tuple):
    """A symbolic scalar: (kind, sympy expression), kind one of int, float, bool."""


def _meta(meta: dict, ranges: dict) -> dict:
    """The picklable part of a node's metadata, fake values encoded."""
    out = {}
    for key, value in meta.items():
        try:
            encoded = _encode(value, ranges)
            pickle.dumps(encoded)
        except Exception:  # noqa: BLE001 - an entry torch or a pass added that cannot travel
            continue
        out[key] = encoded
    return out


def _encode(value: Any, ranges: dict) -> Any:
    if isinstance(value, FakeTensor):
        _note_ranges(value.fake_mode.shape_env, value, ranges)
        return _Fake(
            (
                tuple(_encode(d, ranges) for d in value.shape),
                tuple(_encode(d, ranges) for d in value.stride()),
                _encode(value.storage_offset(), ranges),
                value.dtype,
                str(value.device),
                value.requires_grad,
            )
        )
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        kind = {torch.SymInt: "int", torch.SymFloat: "float", torch.SymBool: "bool"}[type(value)]
        return _Sym((kind, value.node.expr))
    if isinstance(value, torch.memory_format):  # torch.save cannot pickle these
        return _Format(str(value).removeprefix("torch."))
    if isinstance(value, torch.Size):
        return (
            torch.Size(value)
            if all(isinstance(d, int) for d in value)
            else _SizeOf(tuple(_encode(d, ranges) for d in value))
        )
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple (TensorMetadata)
        return _Named((type(value), tuple(_encode(v, ranges) for v in value)))
    if type(value) in (list, tuple):
        return type(value)(_encode(v, ranges) for v in value)
    if type(value) is dict:
        return {k: _encode(v, ranges) for k, v in value.items()}
    return value


class _Format(str):
    """A ``torch.memory_format`` by name."""


class _SizeOf(tuple):
    """A ``torch.Size`` with symbolic sizes."""


class _Named(tuple):
    """A named tuple: (its type, its fields)."""


def _note_ranges(shape_env: ShapeEnv | None, value: FakeTensor, ranges: dict) -> None:
    if shape_env is None:
        return
    for d in (*value.shape, *value.stride()):
        if isinstance(d, torch.SymInt):
            for symbol in d.node.expr.free_symbols:
                if symbol not in ranges:
                    vr = shape_env.var_to_range.get(symbol)
                    ranges[symbol] = (vr.lower, vr.upper) if vr is not None else None


def _fake_mode(ranges: dict) -> FakeTensorMode:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._sympy.value_ranges import ValueRanges

    shape_env = ShapeEnv()
    for symbol, bounds in ranges.items():
        if bounds is not None:
            shape_env.var_to_range[symbol] = ValueRanges(*bounds)
    return FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)


def _decode(value: Any, mode: FakeTensorMode) -> Any:
    if isinstance(value, _Fake):
        sizes, strides, offset, dtype, device, requires_grad = value
        with mode:
            t = torch.empty_strided(
                [_decode(d, mode) for d in sizes],
                [_decode(d, mode) for d in strides],
                dtype=dtype,
                device=device,
            )
            if _decode(offset, mode) != 0:
                t = t.as_strided(t.shape, t.stride(), _decode(offset, mode))
        return t.requires_grad_(requires_grad) if requires_grad else t
    if isinstance(value, _Sym):
        return _symbolic(value, mode.shape_env)
    if isinstance(value, _Format):
        return getattr(torch, value)
    if isinstance(value, _SizeOf):
        return torch.Size([_decode(d, mode) for d in value])
    if isinstance(value, _Named):
        kind, fields = value
        return kind(*(_decode(v, mode) for v in fields))
    if type(value) in (list, tuple):
        return type(value)(_decode(v, mode) for v in value)
    if type(value) is dict:
        return {k: _decode(v, mode) for k, v in value.items()}
    return value


def _symbolic(value: _Sym, shape_env: ShapeEnv) -> Any:
    kind, expr = value
    if not expr.free_symbols:  # a constant after all
        return {"int": int, "float": float, "bool": bool}[kind](expr)
    make = {
        "int": shape_env.create_symintnode,
        "float": shape_env.create_symfloatnode,
        "bool": lambda e, hint: shape_env.create_symboolnode(e),
    }[kind]
    return make(expr, hint=None)


# -- the input guards ---------------------------------------------------------------------------
class InputGuards(nn.Module):
    """The capture's input checks (``torch.export``'s ``_get_input_guards_for_graph``), as data:
    per guarded input its name and either its sizes (an int where the capture fixed it, a sympy
    expression over the dynamic sizes) or the python scalar it was specialised to; per symbol its
    range (the lower bound checked above 2, the upper one when finite, as torch does). Checks
    torch derived from the model's own code (a branch on a size) are not kept. Skipped while the
    model is traced (export: torch checks symbolic sizes itself)."""

    def __init__(self, inputs: list[tuple[str, Any]], ranges: dict):
        super().__init__()
        self.inputs = inputs
        self.ranges = dict(ranges)

    @classmethod
    def of_graph(cls, graph: torch.fx.Graph, ranges: dict) -> InputGuards:
        """The guards of ``graph``'s ``_guards_fn`` call: the sizes or values its arguments were
        captured with (``ranges`` gets the symbols' ranges)."""
        call = next(n for n in graph.nodes if n.op == "call_module" and n.target == _GUARDS)
        inputs = []
        for arg in call.args:
            val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
            source = arg
            while isinstance(source, torch.fx.Node) and source.op != "placeholder" and source.args:
                source = source.args[0]  # a quantizer call reads the placeholder
            name = str(source.target) if isinstance(source, torch.fx.Node) else str(arg)
            if isinstance(val, FakeTensor):
                _note_ranges(val.fake_mode.shape_env, val, ranges)
                sizes = tuple(d.node.expr if isinstance(d, torch.SymInt) else d for d in val.shape)
                inputs.append((name, sizes))
            elif isinstance(val, (int, float)):  # bool included
                inputs.append((name, _Scalar((val,))))
            else:
                inputs.append((name, None))
        return cls(inputs, ranges)

    def forward(self, *args: Any) -> None:
        import sympy

        values: dict[sympy.Symbol, int] = {}
        where: dict[sympy.Symbol, str] = {}  # the size that bound each symbol, for the message
        derived = []
        for (name, spec), arg in zip(self.inputs, args, strict=False):
            if isinstance(spec, _Scalar):
                _check_scalar(name, spec[0], arg)
                continue
            if spec is None or not isinstance(arg, torch.Tensor):
                continue
            if isinstance(arg, FakeTensor) or not all(isinstance(d, int) for d in arg.shape):
                return  # being traced
            if arg.ndim != len(spec):
                raise ValueError(
                    f"input {name!r}: expected {len(spec)} dimensions, got {list(arg.shape)}"
                )
            for axis, (size, want) in enumerate(zip(arg.shape, spec, strict=True)):
                if isinstance(want, sympy.Symbol) and want not in values:
                    values[want], where[want] = size, f"dimension {axis} of input {name!r}"
                    self._check_range(want, size, name, axis)
                elif isinstance(want, sympy.Expr) and want.free_symbols:
                    derived.append((name, axis, size, want))
                elif int(want) != size:
                    raise ValueError(
                        f"input {name!r}: dimension {axis} is {size}; the captured model "
                        f"needs {int(want)}"
                    )
        for name, axis, size, want in derived:
            if want.free_symbols <= values.keys() and int(want.subs(values)) != size:
                sources = ", ".join(
                    f"{s} is {where[s]}" for s in sorted(want.free_symbols, key=str)
                )
                raise ValueError(
                    f"input {name!r}: dimension {axis} is {size}; the captured model needs "
                    f"{want} = {want.subs(values)} ({sources})"
                )

    def _check_range(self, symbol: sympy.Symbol, size: int, name: str, axis: int) -> None:
        lower, upper = (_finite(b) for b in self.ranges.get(symbol) or (None, None))
        lower = lower if lower is not None and lower > 2 else None  # 0/1 are not guarded
        if (lower is not None and size < lower) or (upper is not None and size > upper):
            raise ValueError(
                f"input {name!r}: dimension {axis} is {size}; the captured model accepts "
                f"{lower if lower is not None else 0} to {upper if upper is not None else 'any'}"
            )


def _finite(bound: Any) -> int | None:
    """A range bound as an int; None for an infinite or absent one."""
    import sympy
    from torch.utils._sympy.numbers import int_oo

    if bound is None or bound in (int_oo, -int_oo, sympy.oo, -sympy.oo):
        return None
    return int(bound)


class _Scalar(tuple):
    """A python scalar input the capture specialised to: (its value,)."""


def _check_scalar(name: str, want: int | float, got: Any) -> None:
    if isinstance(got, (int, float)) and not (
        got == want or (math.isnan(want) and math.isnan(got))
    ):
        raise ValueError(
            f"input {name!r} is {got!r}; the model was captured with {want!r} (a python "
            "scalar is part of the captured graph: pass it as a tensor to vary it)"
        )
