"""One-trace export: the ``ExportedProgram`` of a ``QuantModel`` in export mode, built from the
graph ``quantize`` already captured instead of tracing the model a second time.

``quantize`` captures the user's model with ``torch.export`` (``torch._capture``); the QuantModel
is that graph with one ``call_module`` node per quantizer. ``export`` used to trace the QuantModel
again (``torch.export.export``, about 40% of ResNet-18-style's export time): that trace runs the
graph's aten nodes on fake tensors and records them as they are, each quantizer's forward in
export mode adding its one custom op (``torch._export_ops``). This module writes the same program
directly:

* parameters, then buffers (persistent or not, in ``named_buffers`` order, as ``torch.export``
  lifts them), then the user inputs become placeholders, named as ``torch.export`` names them
  (``p_<name>``, ``b_<name>`` lowercased, the forward's argument names); the size queries on
  the inputs (``sym_size``) follow them, as in the trace (``_trace_order``);
* each ``get_attr`` node becomes its placeholder; each quantizer ``call_module`` node is replaced
  by the body of the quantizer's own forward, traced symbolically (``torch.fx``: no fake tensors,
  so the quantizer's export branch is the single source of what it emits); the capture's
  ``_guards_fn`` node is dropped, as the trace drops it. Quantizers of one export form
  (``_form``: class, tensor names, the values its ``export_reads`` names) share one traced body,
  each inlined with its own tensors: a trace costs 1-2 ms (fx patches ``nn.Module`` for it);
  ResNet-18-style calls 73 quantizers of 3 forms, PP-OCRv4 det 567 of 6;
* every node keeps the fake value and metadata the capture gave it; a quantizer's output
  takes the value the capture recorded for its call (an export op returns what fake
  quantization returns), any other new node its operator run on its inputs' fake values;
* range constraints and the call's pytree structure are the capture's.

It is used only when the result is the one the trace would give (``reuse_refusal`` says why
not): the export's dynamic setting is the capture's, the example inputs fit the captured
placeholders (same structure and dtypes, the same static sizes, dynamic sizes inside their
ranges), every parameter and buffer the graph reads still has the captured shape and dtype (a
replaced layer changes it), every node has a captured value, and every quantizer's export
branch traces to plain operator calls. Otherwise ``export`` traces as before.
Tests hold the two paths to the same ONNX file (``tests/onnx/test_one_trace_export.py``). Where
the trace would also record and then drop symbolic-size arithmetic (``dynamic="all"``; MiniLM's
attention), its later nodes carry a higher counter in their names (``add_2``,
``sym_size_int_5``): the file is then the same up to those intermediate names.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import sympy
import torch
from torch._export.verifier import SpecViolationError
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import graph_signature as gs
from torch.utils import _pytree as pytree

from ...torch._fakequant import quantizer_modules

log = logging.getLogger(__name__)

ENABLED = True  # tests switch it off to compare against the re-trace
_GUARDS = "_guards_fn"  # the capture's input-guard module: the trace does not keep it


def reused_program(
    module: torch.fx.GraphModule, args: tuple, kwargs: dict, dynamic: str
) -> torch.export.ExportedProgram | None:
    """The program ``torch.export`` would trace from ``module`` (in export mode) on
    ``(args, kwargs)`` (batch already widened), or None when it cannot be written exactly."""
    if not ENABLED:
        return None
    reason = reuse_refusal(module, args, kwargs, dynamic)
    if reason is not None:
        log.debug("one-trace export not taken: %s", reason)
        return None
    try:
        return _build(module)
    except (_Refused, SpecViolationError) as e:  # the verifier: a captured in-place op (the
        # detach_ of torch.tensor(sizes) in an imported graph under dynamic="all")
        log.debug("one-trace export not taken: %s", e)
        return None


class _Refused(Exception):
    """The graph holds something the builder does not write exactly."""


def reuse_refusal(module: torch.nn.Module, args: tuple, kwargs: dict, dynamic: str) -> str | None:
    """Why the captured graph cannot stand for a new trace, or None when it can."""
    ranges = module.__dict__.get("qb_shape_ranges")
    if not isinstance(module, torch.fx.GraphModule) or ranges is None:
        return "no captured graph with its shape ranges"
    if dynamic != module.__dict__.get("qb_capture", {}).get("dynamic"):
        return f"dynamic={dynamic!r} differs from the capture's"
    codegen = module.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    if info is None or info.in_spec is None:
        return "the graph has no recorded call structure"
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    if spec != info.in_spec:
        return "the example's structure differs from the captured call"
    inputs = [n for n in module.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(leaves):
        return "the example has another number of inputs"
    sizes: dict[sympy.Symbol, int] = {}
    for node, value in zip(inputs, leaves, strict=True):
        why = _fits(node, value, ranges, sizes)
        if why is not None:
            return f"input {node.name!r}: {why}"
    for node in module.graph.nodes:
        if node.op == "get_attr":
            why = _same_tensor(module, node)
            if why is not None:
                return why
        elif node.op in ("call_function", "call_module") and "val" not in node.meta:
            if node.op == "call_module" and node.target == _GUARDS:
                continue
            return f"node {node.name!r} has no captured value (the graph changed since capture)"
        elif node.op == "call_method":
            return f"node {node.name!r} calls a method"
    return None


def _fits(node: torch.fx.Node, value: Any, ranges: dict, sizes: dict) -> str | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        if isinstance(value, torch.Tensor) or val != value:
            return f"{value!r} where the capture saw {val!r}"
        return None
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__} where the capture saw a tensor"
    if value.dtype != val.dtype or value.ndim != val.ndim:
        return f"{value.dtype} {value.ndim}-d where the capture saw {val.dtype} {val.ndim}-d"
    for axis, (dim, size) in enumerate(zip(val.shape, value.shape, strict=True)):
        expr = sympy.Integer(dim) if isinstance(dim, int) else dim.node.expr
        if isinstance(expr, sympy.Integer):  # static (or a dynamic size the model pinned)
            if int(expr) != size:
                return f"dimension {axis} is {size}, captured static at {expr}"
            continue
        if not isinstance(expr, sympy.Symbol) or expr not in ranges:
            return f"dimension {axis} is {expr}, not a plain dynamic size"
        if sizes.setdefault(expr, size) != size:
            return f"dimension {axis} is {size}, another input gives {expr} = {sizes[expr]}"
        bounds = ranges[expr]
        if not bounds.lower <= size <= bounds.upper:
            return f"dimension {axis} is {size}, outside the captured range {bounds}"
    return None


def _same_tensor(module: torch.nn.Module, node: torch.fx.Node) -> str | None:
    """Why the tensor ``node`` reads no longer has the shape the graph was built for, or None."""
    try:
        tensor = module.get_parameter(node.target)
    except AttributeError:
        try:
            tensor = module.get_buffer(node.target)
        except AttributeError:
            return f"{node.target!r} is neither a parameter nor a buffer"
    val = node.meta.get("val")
    built = (tuple(val.shape), val.dtype) if val is not None else node.meta.get("qb_shape")
    if built is None:
        return f"{node.target!r}: the shape the graph was built for is not recorded"
    if built != (tuple(tensor.shape), tensor.dtype):
        return f"{node.target!r} changed since capture (a replaced layer)"
    return None


def _build(module: torch.fx.GraphModule) -> torch.export.ExportedProgram:
    fake_mode = _fake_mode(module)
    graph = torch.fx.Graph()
    specs: list[gs.InputSpec] = []
    lifted: dict[str, torch.fx.Node] = {}  # parameter / buffer name -> placeholder
    state: dict[str, torch.Tensor] = {}
    constants: dict[str, torch.Tensor] = {}
    non_persistent = _non_persistent(module)
    for name, p in module.named_parameters(remove_duplicate=False):
        lifted[name] = _lift(graph, fake_mode, "p_", name, p)
        specs.append(gs.InputSpec(gs.InputKind.PARAMETER, _arg(lifted[name]), name))
        state[name] = p
    for name, b in module.named_buffers(remove_duplicate=False):
        lifted[name] = _lift(graph, fake_mode, "b_", name, b)
        persistent = name not in non_persistent
        specs.append(gs.InputSpec(gs.InputKind.BUFFER, _arg(lifted[name]), name, persistent))
        (state if persistent else constants)[name] = b
    env: dict[torch.fx.Node, Any] = {}
    quantizers = {id(m) for m in quantizer_modules(module)}
    bodies: dict[tuple, torch.fx.Graph] = {}  # export form -> traced body (``_body``)
    outputs: list[gs.OutputSpec] = []
    for node in _trace_order(module.graph):
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
            specs.append(gs.InputSpec(gs.InputKind.USER_INPUT, _user_arg(env[node]), None))
        elif node.op == "get_attr":
            env[node] = lifted[node.target]
        elif node.op == "call_module" and node.target == _GUARDS:
            continue
        elif node.op == "call_module":
            sub = module.get_submodule(node.target)
            if id(sub) not in quantizers:
                raise _Refused(f"call_module {node.target!r} is not a quantizer")
            inputs = [env[a] for a in node.args]
            body = _body(sub, node.target, bodies)
            env[node] = _inline(graph, fake_mode, body, node.target, inputs, lifted, node.meta)
        elif node.op == "call_function":
            new_args = torch.fx.map_arg(node.args, env.__getitem__)
            new_kwargs = torch.fx.map_arg(node.kwargs, env.__getitem__)
            env[node] = _call(graph, node.target, new_args, new_kwargs)
            env[node].meta = dict(node.meta)
        elif node.op == "output":
            result = torch.fx.map_arg(node.args[0], env.__getitem__)
            graph.output(tuple(result) if isinstance(result, list) else result)
            for out in pytree.tree_leaves(result):
                outputs.append(gs.OutputSpec(gs.OutputKind.USER_OUTPUT, _arg(out), None))
        else:
            raise _Refused(f"node {node.name!r} ({node.op})")
    info = module.graph._codegen.pytree_info
    signature = gs.ExportGraphSignature(input_specs=specs, output_specs=outputs)
    call = torch.export.exported_program.ModuleCallSignature(
        inputs=[], outputs=[], in_spec=info.in_spec, out_spec=info.out_spec
    )
    root = torch.fx.GraphModule(module, graph)
    return torch.export.ExportedProgram(
        root=root,
        graph=graph,
        graph_signature=signature,
        state_dict=state,
        range_constraints=dict(module.__dict__["qb_shape_ranges"]),
        module_call_graph=[torch.export.exported_program.ModuleCallEntry("", call)],
        constants=constants,
    )


def _trace_order(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The captured nodes in the order the trace records them: the user inputs first, then the
    size queries on them (``sym_size`` of an input: the trace puts them right after its inputs),
    then the rest (placement put the weights' quantizers before the inputs)."""
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    sizes = [
        n
        for n in nodes
        if n.op == "call_function" and n.target in _SYMBOLIC and n.args[0] in inputs
    ]
    first = set(inputs + sizes)
    return inputs + sizes + [n for n in nodes if n not in first]


def _call(graph: torch.fx.Graph, target: Any, args: tuple, kwargs: dict) -> torch.fx.Node:
    """A ``call_function`` node named as the trace names it: an operator by its packet
    (``mean`` for ``aten.mean.dim``, ``proxy_tensor``), anything else by fx's default."""
    name = None
    if isinstance(target, torch._ops.OpOverload) and target not in _SYMBOLIC:
        name = graph._target_to_str(target.overloadpacket.__name__)
    return graph.create_node("call_function", target, args, kwargs, name=name)


# size queries the trace records from symbolic sizes, under fx's default names (``sym_size_int``)
_SYMBOLIC = {
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
}


def _overload(op: Any, target: str) -> Any:
    """The overload a call of ``op`` dispatches to, as the trace records it (fx keeps the packet:
    ``torch.ops.quantbridge.dequantize``, the trace ``...dequantize.default``)."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        if op.overloads() != ["default"]:
            raise _Refused(f"quantizer {target!r} calls {op}, which has several overloads")
        return op.default
    if not isinstance(op, torch._ops.OpOverload):
        raise _Refused(f"quantizer {target!r} calls {op}, not an operator")
    return op


class _BufferTracer(torch.fx.Tracer):
    """Symbolic trace in which the module's buffers are graph inputs (``get_attr``), so an
    operator on buffers alone (a weight's ``dequantize``) is recorded, not run.

    No autowrapping (fx's default wraps ``math``'s functions): its check scans the globals of
    every function the trace enters, about half of the trace's time (ResNet-18-style: 72
    quantizers, 0.23 -> 0.12 s, the same graphs). An export branch calling ``math`` on a value
    would then fail to trace and be refused (``_inline``): the export re-traces instead."""

    proxy_buffer_attributes = True

    def __init__(self):
        super().__init__(autowrap_modules=(), autowrap_functions=())


def _fake_mode(module: torch.fx.GraphModule):
    for node in module.graph.nodes:
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode
    raise _Refused("no fake tensor in the captured graph")


def _non_persistent(module: torch.nn.Module) -> set[str]:
    found = set()
    for prefix, m in module.named_modules(remove_duplicate=False):
        for name in m._non_persistent_buffers_set:
            found.add(f"{prefix}.{name}" if prefix else name)
    return found


def _arg(node: torch.fx.Node) -> gs.TensorArgument:
    return gs.TensorArgument(name=node.name)


def _user_arg(node: torch.fx.Node) -> gs.TensorArgument | gs.ConstantArgument:
    """A user input's argument as the trace records it: a plain value the capture saw
    (``use_cache=False``, ``None``) is a constant of the program, not a tensor input (as a
    tensor it became an int64 ONNX graph input that a later call could not feed)."""
    val = node.meta.get("val")
    if isinstance(val, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _arg(node)
    return gs.ConstantArgument(name=node.name, value=val)


def _lift(graph: torch.fx.Graph, fake_mode, prefix: str, name: str, tensor: torch.Tensor):
    node = graph.placeholder(prefix + re.sub(r"[^a-zA-Z0-9]", "_", name).lower())  # as export
    node.meta["val"] = _fake(fake_mode, tensor)
    return node


def _fake(fake_mode, tensor: torch.Tensor):
    """``fake_mode.from_tensor(tensor, static_shapes=True)`` for a plain dense tensor that owns
    its storage from offset 0 (a parameter or a quantizer's buffer): the same sizes, strides,
    dtype, device, ``requires_grad`` and parameter mark, built directly. ``from_tensor`` first
    describes the tensor for its converter (views, symbolic sizes, memo), about 10x the cost:
    0.5 ms a tensor under load, and an export lifts every parameter and buffer (PP-OCRv4 det:
    3,183, most of them quantizers' scales and zero points). Anything else, or a torch whose
    ``FakeTensor`` is built otherwise, goes through ``from_tensor``."""
    if (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and tensor._base is None
        and tensor.storage_offset() == 0
        and not tensor.is_quantized
        and not tensor.is_neg()
        and not tensor.is_conj()
    ):
        try:
            meta = torch.empty_strided(
                tensor.shape,
                tensor.stride(),
                dtype=tensor.dtype,
                device="meta",
                requires_grad=tensor.requires_grad,
            )
            fake = FakeTensor(fake_mode, meta, tensor.device)
        except Exception as e:  # noqa: BLE001 - another torch: its own conversion
            log.debug("direct fake tensor unavailable: %s", e)
        else:
            if isinstance(tensor, torch.nn.Parameter):
                fake._is_param = True  # as the converter marks a parameter's fake
            return fake
    return fake_mode.from_tensor(tensor, static_shapes=True)


def _body(quantizer: torch.nn.Module, target: str, bodies: dict) -> torch.fx.Graph:
    """The symbolic trace of ``quantizer``'s forward (export mode), its buffers read by their
    names in it: taken from ``bodies`` when a quantizer of the same form was traced."""
    form = _form(quantizer)
    body = bodies.get(form) if form is not None else None
    if body is None:
        try:
            body = _BufferTracer().trace(quantizer)
        except Exception as e:  # noqa: BLE001 - a forward that needs values: the trace decides
            raise _Refused(f"quantizer {target!r}: {type(e).__name__}: {e}") from None
        if form is not None:
            bodies[form] = body
    return body


_ABSENT = ("absent",)  # an attribute ``export_reads`` names that the quantizer does not have


def _form(quantizer: torch.nn.Module) -> tuple | None:
    """All that ``quantizer``'s traced forward depends on (None: unknown, trace it alone): its
    class, its tensors' and submodules' names (which are None, which alias: the trace names a
    tensor by its first name), the values its class's ``export_reads`` names. Tensors' values are
    not traced (``get_attr``). Unknown where ``forward`` (or ``_exporting``, ``active``) is
    defined below the class stating ``export_reads``."""
    cls = type(quantizer)
    stated = _owner(cls, "export_reads")
    if stated is None or any(
        owner is not None and not issubclass(stated, owner)
        for owner in (_owner(cls, m) for m in ("forward", "_exporting", "active"))
    ):
        return None
    values = []
    for name in cls.export_reads:
        value = getattr(quantizer, name, _ABSENT)
        values.append(value() if callable(value) else value)
    tensors = [*quantizer._parameters.items(), *quantizer._buffers.items()]
    ids = [id(t) for _, t in tensors]
    aliases = tuple((n, None if t is None else ids.index(id(t))) for n, t in tensors)
    form = (cls, len(quantizer._parameters), aliases, tuple(quantizer._modules), tuple(values))
    try:
        hash(form)
    except TypeError:
        return None
    return form


def _owner(cls: type, name: str) -> type | None:  # the class in ``cls``'s MRO defining ``name``
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def _inline(graph, fake_mode, body, target: str, inputs: list, lifted: dict, meta: dict):
    """The nodes of a quantizer's traced forward ``body`` (``_body``) on ``inputs``, reading the
    tensors of the quantizer at ``target``; returns its output."""
    env: dict[torch.fx.Node, Any] = {}
    placeholders = iter(inputs)
    result = next(n for n in reversed(body.nodes) if n.op == "output").args[0]
    for node in body.nodes:
        if node.op == "placeholder":  # the inputs, then unused options
            env[node] = next(placeholders, None)
            if env[node] is None and node.users:
                raise _Refused(f"quantizer {target!r} uses its argument {node.target!r}")
        elif node.op == "get_attr":
            name = f"{target}.{node.target}"
            if name not in lifted:
                raise _Refused(f"quantizer {target!r} reads {node.target!r}, not a buffer")
            env[node] = lifted[name]
        elif node.op == "call_function":
            args = torch.fx.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.map_arg(node.kwargs, env.__getitem__)
            op = _overload(node.target, target)
            new = _call(graph, op, args, kwargs)
            if node is result and "val" in meta:
                # the quantizer's output: the value the capture recorded for it (an export op
                # returns what fake quantization returns: ``_export_ops``); dispatching on fake
                # tensors again costs ~10 ms per quantizer in symbolic shape arithmetic
                new.meta["val"] = meta["val"]
            else:
                with fake_mode:
                    new.meta["val"] = op(
                        *torch.fx.map_arg(args, lambda n: n.meta["val"]),
                        **torch.fx.map_arg(kwargs, lambda n: n.meta["val"]),
                    )
            for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                if key in meta:
                    new.meta[key] = meta[key]
            env[node] = new
        elif node.op == "output":
            return env[node.args[0]]
        else:
            raise _Refused(f"quantizer {target!r}: {node.op} {node.target}")
    raise _Refused(f"quantizer {target!r}: no output")
