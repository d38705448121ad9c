"""``OnnxModule``: the ``nn.Module`` that ``import_onnx`` returns, and how it runs the graph.

``forward`` walks the import's steps in topological order. Each step knows where its inputs come
from (``_Step.sources``): a value computed earlier (``env``), a registered buffer, or a numpy
constant passed as a value (shapes, axes, scalars); and how it runs: as a layer (the submodule
is called, so ``torch.export`` records it in ``nn_module_stack``), in numpy on python sizes
(``host``: shape arithmetic), or as torch ops. Values are dropped after their last use.

Arithmetic nodes that are not layers (``Add``, ``Sub``, ``Mul``, ``Div``, ``MatMul`` of two
tensors: ``SCOPED_OPS``) run inside an ``OnnxOp`` submodule named after the ONNX node (the
node name as a python identifier, ``p2o.Add.248`` -> ``p2o_Add_248``; its class name is the op
type), so ``torch.export`` records them in ``nn_module_stack`` like a hand-written model's
functional add inside a block: recipe rules (``Rule(pattern="p2o_Add_248", skip=True)``,
``Rule(module_type="Add")``), sensitivity and ``float_outlier_residuals`` can name one of them.
An ``OnnxOp`` holds no parameters or buffers (the state dict is unchanged).

``forward`` is generated with one parameter per graph input (``x`` for PP-OCR), because
``torch.export``'s dynamic shapes, ``torch.fx`` and ``qb.quantize(..., dynamic=)`` read the
argument names from the signature.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ._registry import OnnxNode, OpHandler, as_tensor
from ._symbolic import SymbolicWatch, declared_dynamic


def _identifier(name: str, taken: set[str]) -> str:
    base = re.sub(r"\W", "_", name).strip("_") or "node"
    if base[0].isdigit() or keyword.iskeyword(base) or hasattr(nn.Module, base):
        base = f"n_{base}"
    attr, i = base, 1
    while attr in taken:
        i += 1
        attr = f"{base}_{i}"
    taken.add(attr)
    return attr


SCOPED_OPS = frozenset({"Add", "Sub", "Mul", "Div", "MatMul"})


class OnnxOp(nn.Module):
    """The scope of one non-layer ONNX node (module docstring): calls its op handler."""

    def __init__(self, node: OnnxNode, handler: OpHandler):
        super().__init__()
        self.node, self.handler = node, handler

    def forward(self, *args):
        return self.handler.fn(self.node, *args)

    def extra_repr(self) -> str:
        return repr(self.node.name)

    def __reduce_ex__(self, protocol):
        """Pickled with its op type: its class is made at import (``_op_class``)."""
        return _restore, (_op_class, (self.node.op_type,)), self.__dict__


_OP_CLASSES: dict[str, type] = {}


def _op_class(op_type: str) -> type:
    """The ``OnnxOp`` subclass named ``op_type`` (one per op type and process)."""
    cls = _OP_CLASSES.get(op_type)
    if cls is None:
        cls = type(op_type, (OnnxOp,), {"__module__": __name__})
        _OP_CLASSES[op_type] = cls
    return cls


def _op_scope(node: OnnxNode, handler: OpHandler) -> OnnxOp:
    """An ``OnnxOp`` whose class is named after the op type (rules' ``module_type="Add"``)."""
    return _op_class(node.op_type)(node, handler)


def _restore(make_class, key: tuple) -> nn.Module:
    """Unpickling an ``OnnxOp`` or ``OnnxModule``: an empty instance of its class, made again
    from ``key``; pickle then sets its state."""
    cls = make_class(*key)
    return cls.__new__(cls)


@dataclass
class _Step:
    node: OnnxNode
    handler: OpHandler
    sources: list  # per input: ("env", name) | ("buffer", attr) | ("value", array) | None
    outputs: list[str]
    mode: str  # "layer" | "host" | "torch" | "scope" (torch, inside an ``OnnxOp``)
    layer: str | None = None
    release: list[str] = field(default_factory=list)


class OnnxModule(nn.Module):
    """A float torch model imported from ONNX by ``quantbridge.import_onnx``.

    ``onnx_names`` maps each submodule and buffer attribute to the ONNX node or constant it came
    from; ``input_names`` / ``output_names`` are the graph's. ``forward`` takes the graph inputs
    (positionally or by their python-identifier names) and returns one tensor or a tuple.
    """

    def __init__(self, graph, layers: dict, integer_consts: frozenset[str] = frozenset()):
        super().__init__()
        self.onnx_names: dict[str, str] = {}
        self.input_names = list(graph.inputs)
        self.output_names = list(graph.outputs)
        self.arg_names = _identifiers(graph.inputs)
        self.dynamic_dims = declared_dynamic(graph.proto.graph, graph.inputs)
        self._taken = set(dir(self))
        self._buffer_of: dict[str, str] = {}  # constant name -> buffer attribute
        self._integer_consts = integer_consts  # never python scalars (a grid is attached later)
        self._steps: list[_Step] = []
        host_values: set[str] = set()
        for node in graph.nodes:
            layer, attr = layers.get(node.name), None
            if layer is not None:
                attr = _identifier(node.name, self._taken)
                self.add_module(attr, layer[0])
                self.onnx_names[attr] = node.name
            self._steps.append(self._plan(node, graph, layer, attr, host_values))
        self._outputs = [self._source(n, 0, None, None, graph, True) for n in graph.outputs]
        _schedule_release(self._steps, set(graph.outputs))
        del self._taken, self._buffer_of, self._integer_consts
        self.eval()

    @property
    def qb_io_names(self) -> dict:
        """The ONNX file's input and output names, for the layers that show or write them
        (``qb.quantize`` records them, ``qb.export`` names the graph's inputs and outputs after
        them, input errors quote them): ``inputs``, ``[forward parameter, graph input]`` pairs
        in order; ``outputs``, the graph outputs in the order ``forward`` returns them."""
        return {
            "inputs": [[a, n] for a, n in zip(self.arg_names, self.input_names, strict=True)],
            "outputs": list(self.output_names),
        }

    def __reduce_ex__(self, protocol):
        """Pickled with its argument names: its class is made at import (``_module_class``)."""
        return _restore, (_module_class, (tuple(self.arg_names),)), self.__dict__

    def _plan(self, node, graph, layer, attr, host_values: set) -> _Step:
        """How ``node`` runs: as a layer, in numpy on sizes (all its data inputs are constants
        or sizes and the op has a numpy form), or in torch; and where each input comes from."""
        handler = graph.handler(node)
        consumed = layer[1] if layer else ()
        kinds = [_kind(i, graph.consts, host_values) for i in node.inputs]
        data_kinds = [k for p, k in enumerate(kinds) if p not in handler.static and k]
        host = handler.always_host or (
            handler.host is not None
            and layer is None
            and all(k in ("const", "host") for k in data_kinds)
        )
        if host:
            host_values.update(o for o in node.outputs if o)
        sources = [
            self._source(name, p, node, handler, graph, host)
            for p, name in enumerate(node.inputs)
            if not (layer and p in consumed)
        ]
        mode = "layer" if layer else ("host" if host else "torch")
        if mode == "torch" and node.op_type in SCOPED_OPS:
            mode, attr = "scope", _identifier(node.name, self._taken)
            self.add_module(attr, _op_scope(node, handler))
            self.onnx_names[attr] = node.name
        return _Step(node, handler, sources, node.outputs, mode, attr)

    def _source(self, name, position, node, handler, graph, host):
        if not name:
            return None
        if name not in graph.consts:
            return ("env", name)
        value = graph.consts[name]
        if (
            host
            or position in handler.static
            or (
                handler.elementwise
                and name not in self._integer_consts
                and _scalar_ok(value, node, position)
            )
        ):
            return ("value", value)
        if name not in self._buffer_of:
            attr = _identifier(name, self._taken)
            self.register_buffer(attr, torch.from_numpy(np.array(value, copy=True)))
            self.onnx_names[attr] = name
            self._buffer_of[name] = attr
        return ("buffer", self._buffer_of[name])

    def _fetch(self, env: dict, source):
        if source is None:
            return None
        kind, ref = source
        if kind == "env":
            return env[ref]
        if kind == "buffer":
            return getattr(self, ref)
        return ref

    def run(self, values: dict[str, Any], stand_ins: dict | None = None):
        """Evaluate the graph on ``{onnx input name: tensor}``. ``stand_ins`` (the fake run of
        ``_symbolic.check_at_import``): op type -> a function giving a torch step's output from
        its inputs without computing it, or None to compute it."""
        env = dict(values)
        watch = SymbolicWatch(values, self.dynamic_dims)
        for step in self._steps:
            args = [self._fetch(env, s) for s in step.sources]
            stand_in = (stand_ins or {}).get(step.node.op_type) if step.mode == "torch" else None
            try:
                out = stand_in(step.node, *args) if stand_in is not None else None
                out = self._call(step, args) if out is None else out
            except _NAMED_ERRORS as e:
                if type(e) not in _NAMED_ERRORS:  # torch's own subclasses steer tracing: as is
                    raise
                raise type(e)(f"ONNX node {step.node.name!r} ({step.node.op_type}): {e}") from e
            if watch.active:
                watch.check(step.node)
            outs = out if isinstance(out, tuple) else (out,)
            if step.mode == "host":  # numpy returns scalars for 0-d results; keep arrays
                outs = tuple(o if isinstance(o, _HOST_TYPES) else _array(o) for o in outs)
            for name, value in zip(step.outputs, outs, strict=False):  # optional outputs
                if name:
                    env[name] = value
            for name in step.release:
                env.pop(name, None)
        results = tuple(as_tensor(self._fetch(env, s)) for s in self._outputs)
        return results[0] if len(results) == 1 else results

    def _call(self, step: _Step, args: list):
        if step.mode == "layer":
            return step.handler.layer.call(step.node, getattr(self, step.layer), *args)
        if step.mode == "scope":
            return getattr(self, step.layer)(*args)
        if step.mode == "host":
            if step.handler.always_host:
                return step.handler.fn(step.node, *args)
            if any(isinstance(a, torch.Tensor) for a in args):
                # a host step upstream kept a symbolic size by running in torch (``Expand`` of a
                # constant to ``[batch, 1, D]``): this one follows it into torch
                return step.handler.fn(step.node, *args)
            return step.handler.host(step.node, *args)
        return step.handler.fn(step.node, *args)

    def extra_repr(self) -> str:
        return f"inputs={self.input_names}, outputs={self.output_names}, nodes={len(self._steps)}"


# errors of a node's computation (a shape mismatch at run time) get the node's name, as ONNX
# Runtime's messages do ("Add node. Name:'p2o.Add.248'")
_NAMED_ERRORS = (RuntimeError, ValueError, IndexError)
_HOST_TYPES = (np.ndarray, torch.Tensor)


def _array(value) -> np.ndarray:
    """A 0-d array for a python / numpy scalar or a SymInt (object dtype)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        out = np.empty((), dtype=object)
        out[()] = value
        return out
    return np.asarray(value)


def _kind(name: str, consts: dict, host_values: set) -> str | None:
    if not name:
        return None
    if name in consts:
        return "const"
    return "host" if name in host_values else "tensor"


def _scalar_ok(value: np.ndarray, node: OnnxNode, position: int) -> bool:
    """A size-1 constant can be a python scalar when that does not change the output's rank."""
    if value.size != 1 or value.dtype == object:
        return False
    if value.ndim == 0:
        return True
    others = [r for p, r in enumerate(node.ranks) if p != position and node.inputs[p]]
    if others and all(r is not None for r in others):
        return value.ndim <= max(others)
    return value.ndim <= 1


def _schedule_release(steps: list[_Step], keep: set[str]) -> None:
    """Drop each intermediate value from the environment after its last use."""
    last: dict[str, int] = {}
    for i, step in enumerate(steps):
        for s in step.sources:
            if s is not None and s[0] == "env":
                last[s[1]] = i
    for name, i in last.items():
        if name not in keep:
            steps[i].release.append(name)


def new_module(graph, layers: dict, integer_consts: frozenset[str] = frozenset()) -> OnnxModule:
    """An ``OnnxModule`` whose ``forward`` signature names the graph inputs (``torch.export``
    and ``qb.quantize(..., dynamic=...)`` key dynamic dimensions by argument name).
    ``integer_consts``: constants a quantized file stores as integers; they are buffers even when
    of size 1 (a python scalar could not carry the file's grid, ``_qmodel``)."""
    return _module_class(tuple(_identifiers(graph.inputs)))(graph, layers, integer_consts)


_MODULE_CLASSES: dict[tuple[str, ...], type] = {}


def _module_class(arg_names: tuple[str, ...]) -> type:
    """The ``OnnxModule`` subclass whose ``forward`` takes ``arg_names`` (one per tuple of names
    and process)."""
    cls = _MODULE_CLASSES.get(arg_names)
    if cls is None:
        forward = _forward_function(list(arg_names))
        cls = type("OnnxModule", (OnnxModule,), {"forward": forward, "__module__": __name__})
        _MODULE_CLASSES[arg_names] = cls
    return cls


def _identifiers(names: list[str]) -> list[str]:
    taken = set(dir(OnnxModule)) | {"self"}  # ``forward``'s own first parameter
    return [_identifier(n, taken) for n in names]


def _forward_function(arg_names: list[str]):
    """``def forward(self, <one parameter per graph input>)``, generated so that every tracer
    (``torch.export``, ``torch.fx.symbolic_trace``, ``inspect.signature``) sees the real names."""
    args = ", ".join(arg_names)
    source = (
        f"def forward(self{', ' if args else ''}{args}):\n"
        f"    return self.run(dict(zip(self.input_names, [{args}])))\n"
    )
    namespace: dict = {}
    exec(compile(source, "<quantbridge.import_onnx>", "exec"), namespace)  # noqa: S102 - identifiers only
    return namespace["forward"]
