"""The one call into torch's ONNX exporter: a module in export mode -> an ``onnx.ModelProto``.

``torch.onnx.export(dynamo=True)`` runs three stages: ``torch.export`` (a trace), a
decomposition to the operators its translation library (onnxscript's torchlib) implements --
``ExportedProgram.run_decompositions``, a second full trace that costs more than the first
(1.5 s of a 3 s ResNet-18 export) -- and the translation itself.

Our export-mode graphs mostly need no decomposition: their operators (conv2d, linear, add, our
two custom ops ...) are translated directly. What they do hold is in-place activations
(``relu_``, ``hardtanh_``) from modules built with ``inplace=True``, and the odd operator that
torchlib leaves to a decomposition (``adaptive_avg_pool2d``). The fast path therefore traces
once, rewrites those few nodes itself -- an in-place op becomes its functional twin when the
mutated value is a fresh (non-view, non-input) result, with later readers redirected to the new
value, which is what functionalization would do; ``adaptive_avg_pool2d`` to 1x1 becomes a mean
over the spatial axes, ``Tensor.to`` a cast, ``&`` a bitwise and, a transposed convolution
``convolution(transposed=True)``, ``squeeze`` on a list of axes ``squeeze`` on its one size-1
axis, ``reshape_as`` a ``reshape`` to the other tensor's sizes, an inference batch norm that was
not folded the ``_native_batch_norm_legit_no_training`` + ``getitem`` pair, as the decomposition
table has them -- and hands the program to the translator without the second trace.

Anything else (an operator neither translated nor rewritten, a mutation of a view or an input, an
exporter whose internals moved) takes the public path with the program already traced, so the
result never depends on the fast path being available. Tests hold the two paths to identical
ONNX Runtime outputs.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
from typing import Any

import onnx
import torch
from torch.export.graph_signature import InputKind, TensorArgument

from ...torch._ops import TRANSPOSED_CONV_OPS
from ._io_names import rename_values
from ._lazy_registry import lazy_registry
from ._merged_calls import CALLS_KEY, calls_after, quantize_calls
from ._optimize import first_output_filtered
from ._promotion import promotion_needed
from ._signature import record_signature
from ._tiny_constants import keep_tiny_constants
from ._translate import translation_table

log = logging.getLogger(__name__)

FAST_PATH = True  # tests switch it off to compare against the public path

# in-place op -> functional op with the same arguments
_INPLACE = {
    torch.ops.aten.relu_.default: torch.ops.aten.relu.default,
    torch.ops.aten.hardtanh_.default: torch.ops.aten.hardtanh.default,
    torch.ops.aten.hardswish_.default: torch.ops.aten.hardswish.default,
    torch.ops.aten.hardsigmoid_.default: torch.ops.aten.hardsigmoid.default,
    torch.ops.aten.silu_.default: torch.ops.aten.silu.default,
    torch.ops.aten.leaky_relu_.default: torch.ops.aten.leaky_relu.default,
    torch.ops.aten.sigmoid_.default: torch.ops.aten.sigmoid.default,
    torch.ops.aten.tanh_.default: torch.ops.aten.tanh.default,
    torch.ops.aten.add_.Tensor: torch.ops.aten.add.Tensor,
    torch.ops.aten.mul_.Tensor: torch.ops.aten.mul.Tensor,
}


def export_program(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    dynamic_shapes: Any,
    opset: int,
    program: torch.export.ExportedProgram | None = None,
) -> onnx.ModelProto:
    """Trace ``module`` once (unless ``program``, its trace, is given: ``_reuse``) and translate
    it to ONNX at ``opset`` (optimized, as torch does).

    The call's signature (args, kwargs and output structure) goes into the model's metadata
    (``_signature``)."""
    if program is None:
        program = torch.export.export(
            module, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False
        )
    model = _fast(program, opset) if FAST_PATH else None
    if model is None:
        try:
            onnx_program = torch.onnx.export(
                program,
                dynamo=True,
                custom_translation_table=translation_table(opset),
                opset_version=opset,
                optimize=False,  # optimized below, after keep_tiny_constants (as torch would)
                verbose=False,
            )
        except Exception as e:
            untranslated = _untranslated_ops(program, str(e))
            if not untranslated:
                raise
            raise ValueError(untranslated) from e
        keep_tiny_constants(onnx_program.model)
        model = _optimized(onnx_program)
        _keep_input_names(model, program, onnx_program.exported_program)
    record_signature(model, program, module.forward)
    return model


def _user_inputs(program: torch.export.ExportedProgram | None) -> list[str]:
    specs = program.graph_signature.input_specs if program is not None else []
    return [
        s.arg.name
        for s in specs
        if s.kind == InputKind.USER_INPUT and isinstance(s.arg, TensorArgument)
    ]


def _keep_input_names(
    model: onnx.ModelProto,
    program: torch.export.ExportedProgram,
    decomposed: torch.export.ExportedProgram | None,
) -> None:
    """The traced input names (``forward``'s: ``x``) back on the public path's graph inputs.

    Its decomposition trace renames the user inputs (``x`` -> ``arg_0``) while the signature
    (``record_signature``) and the fast path use the traced ones: an export by the public path
    (any operator left to the decomposition, e.g. ``adaptive_avg_pool2d`` to 2x2) could not be
    called by name, nor run by ``qb.to_engine``. The two lists pair up in order."""
    traced, got = _user_inputs(program), _user_inputs(decomposed)
    graph_inputs = {v.name for v in model.graph.input}
    if len(traced) != len(got) or not set(got) <= graph_inputs:
        return  # nothing to pair safely: the engine layer then says which input is missing
    rename_values(model.graph, dict(zip(got, traced, strict=True)))


def _optimized(onnx_program: Any) -> onnx.ModelProto:
    """torch's optimizer on ``onnx_program``; the model records which QuantizeLinear each
    quantizer call became (``_merged_calls``: the optimizer merges identical ones)."""
    before = quantize_calls(onnx_program.model.graph)
    with first_output_filtered():  # the same rewrites, without quadratic matching
        onnx_program.optimize()
    model = onnx_program.model_proto
    names = {n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    entry = model.metadata_props.add()
    entry.key, entry.value = CALLS_KEY, json.dumps(calls_after(before, names))
    return model


@functools.cache
def _registry(opset: int) -> Any:
    """torchlib's registry for ``opset`` with our two custom ops (built once per process; its
    torchlib entries per operator on first lookup, ``_lazy_registry``)."""
    from torch.onnx._internal.exporter import _constants

    registry = lazy_registry(max(opset, _constants.TORCHLIB_OPSET))
    for op, fn in translation_table(opset).items():
        registry.register_op(op, fn, is_complex=False)
    return registry


def _fast(program: torch.export.ExportedProgram, opset: int) -> onnx.ModelProto | None:
    """The program translated without the decomposition trace, or None to take the public path."""
    try:
        from torch.onnx._internal._lazy_import import onnxscript_apis
        from torch.onnx._internal.exporter import _core, _fx_passes
    except ImportError as e:  # another torch: its internals moved
        log.debug("ONNX fast path unavailable: %s", e)
        return None
    try:  # every step keeps the program's meaning, so the public path may take it from here
        registry = _registry(opset)
        graph_module = _fx_passes.remove_assertion_nodes(program.graph_module)
        reason = _rewrite(graph_module)
        if reason is None:
            missing = sorted(
                {
                    str(node.target)
                    for node in graph_module.graph.nodes
                    if node.op == "call_function" and not _translated(registry, node.target)
                }
            )
            reason = f"{', '.join(missing)} need a decomposition" if missing else None
        graph_module.recompile()
        program._graph_module = graph_module
    except Exception as e:  # internals that moved (AttributeError, TypeError ...)
        log.debug("ONNX fast path unavailable: %s", e)
        return None
    if reason is not None:
        log.debug("ONNX fast path not taken: %s", reason)
        return None
    try:
        if promotion_needed(graph_module):  # a re-run of the graph on fake tensors: skipped
            _fx_passes.insert_type_promotion_nodes(graph_module)  # where it would change nothing
        onnx_program = _core._exported_program_to_onnx_program(program, registry=registry)
        onnx_program.model = onnxscript_apis.convert_version(onnx_program.model, opset)
        keep_tiny_constants(onnx_program.model)
        return _optimized(onnx_program)
    except Exception as e:  # the public path is the reference: never fail where it would not
        log.debug("ONNX fast path failed (%s); using torch.onnx.export", e)
        return None


def _translated(registry: Any, target: Any) -> bool:
    if target.__module__ == "_operator":  # getitem, symbolic shape arithmetic
        return True
    return registry.is_registered(target)


def _rewrite(gm: torch.fx.GraphModule) -> str | None:
    """Functional twins for in-place ops, then ``_SUBSTITUTES``; a reason if unsafe.

    Checks everything before changing anything, so a refused graph is left as it was.
    """
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    inplace = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _INPLACE:
            continue
        target = node.args[0]
        if not isinstance(target, torch.fx.Node) or target.op != "call_function":
            return f"{node.name} mutates {getattr(target, 'name', target)}, not a fresh value"
        schema = getattr(target.target, "_schema", None)
        if schema is None or any(r.alias_info is not None for r in schema.returns):
            return f"{node.name} mutates {target.name}, a view or an alias"
        inplace.append(node)
    graph = gm.graph
    for node in inplace:
        target = node.args[0]
        later = [u for u in target.users if u is not node and order[u] > order[node]]
        with graph.inserting_after(node):
            functional = graph.call_function(_INPLACE[node.target], node.args, node.kwargs)
        order[functional] = order[node]
        for user in later:  # readers after the mutation saw the mutated value
            user.replace_input_with(target, functional)
        _replace(graph, node, functional)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.aten.batch_norm.default:
            _inference_batch_norm(graph, node)
            continue
        if node.op != "call_function" or node.target not in _SUBSTITUTES:
            continue
        call = _SUBSTITUTES[node.target](*node.args, **node.kwargs)
        if call is None:
            continue
        if isinstance(call, torch.fx.Node):  # the op is the identity here
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            continue
        with graph.inserting_after(node):
            new = graph.call_function(*call)
        _replace(graph, node, new)
    return None


def _adaptive_avg_pool2d(x, output_size):
    if list(output_size) != [1, 1]:
        return None  # left to the decomposition (the public path)
    return torch.ops.aten.mean.dim, (x, [-1, -2], True)


def _to(x, *args, **kwargs):
    """``Tensor.to`` (dtype / device / keyword overloads) -> a dtype cast, or the identity."""
    dtype = kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
    if dtype is None:
        return x  # device only: every tensor here is on the CPU
    return torch.ops.aten._to_copy.default, (x,), {"dtype": dtype}


def _conv_transpose(x, weight, bias=None, stride=None, padding=None, output_padding=None,
                    groups=1, dilation=None):  # fmt: skip
    """``conv_transposeNd`` -> ``convolution(..., transposed=True)``, defaults spelled out."""
    n = weight.meta["val"].ndim - 2
    ones, zeros = [1] * n, [0] * n
    return torch.ops.aten.convolution.default, (
        x, weight, bias, stride or ones, padding or zeros, dilation or ones, True,
        output_padding or zeros, groups,
    )  # fmt: skip


def _squeeze_dims(x, dims):
    """``squeeze(x, dims)`` -> ``squeeze.dim`` on the one listed axis whose size is 1 (torch
    leaves listed axes of another size alone; ONNX ``Squeeze`` would fail on them), the identity
    when none is, ``squeeze`` when the list names every size-1 axis; a symbolic size among the
    listed axes is left to the decomposition (the public path). PP-OCRv4's recognizer: its 7
    ``squeeze.dims`` were the one operator sending its 3000-node export to the decomposition
    (134 s of a 180 s export under the profiler)."""
    shape = x.meta["val"].shape
    axes = sorted({d % len(shape) for d in dims}) if len(shape) else []
    if any(not isinstance(shape[d], int) for d in axes):
        return None
    ones = [d for d in axes if shape[d] == 1]
    if not ones:
        return x
    if len(ones) == 1:
        return torch.ops.aten.squeeze.dim, (x, ones[0])
    if all(isinstance(n, int) for n in shape) and ones == [
        d for d, n in enumerate(shape) if n == 1
    ]:
        return torch.ops.aten.squeeze.default, (x,)
    return None


def _reshape_as(x, other):
    """``reshape_as(x, other)`` -> ``reshape(x, other's shape)``, a symbolic size read from
    ``other`` by ``sym_size.int`` (as ``Tensor.reshape_as`` does: ``reshape(other.size())``).
    HF LeViT's 22 ``reshape_as`` (batch norm on a flattened sequence) were the one operator
    sending its export to the decomposition (25 of a 42 s export)."""
    shape = []
    for d, n in enumerate(other.meta["val"].shape):
        if isinstance(n, int):
            shape.append(n)
            continue
        with other.graph.inserting_after(other):
            size = other.graph.call_function(torch.ops.aten.sym_size.int, (other, d))
        size.meta["val"] = n
        shape.append(size)
    return torch.ops.aten.reshape.default, (x, shape)


def _rsub(x, other, alpha=1):
    """``other - x`` (``rsub.Scalar``: ``1.0 - attention_mask``) of an integer ``x`` -> the same
    on ``x`` cast to the result dtype first. torch's decomposition writes it ``sub.Tensor(1.0,
    x)``, on which its own type-promotion pass fails for an integer ``x`` ("Cannot find a
    compatible OpOverload for aten.sub": Hugging Face XLNet's ``1.0 - attention_mask`` on an
    int64 mask, float and quantized models alike, torch 2.13); on a float ``x`` it exports as
    ``Sub(1.0, x)``, the form the integer lowering reads for masks. torchlib has no ``rsub``:
    the export still takes the public path, as before."""
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.is_floating_point():
        return None  # left as it is
    dtype = torch.result_type(val, other)
    if not dtype.is_floating_point:
        return None
    with x.graph.inserting_after(x):
        cast = x.graph.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": dtype})
    cast.meta["val"] = val.to(dtype)
    return torch.ops.aten.rsub.Scalar, (cast, other, alpha)


# operator -> function of its arguments giving (target, args[, kwargs]), a node (identity) or
# None (keep): what torch's decomposition table would turn the operator into
_SUBSTITUTES = {
    **dict.fromkeys(TRANSPOSED_CONV_OPS, _conv_transpose),
    torch.ops.aten.adaptive_avg_pool2d.default: _adaptive_avg_pool2d,
    torch.ops.aten.squeeze.dims: _squeeze_dims,
    torch.ops.aten.reshape_as.default: _reshape_as,
    torch.ops.aten.rsub.Scalar: _rsub,
    torch.ops.aten.to.dtype: _to,
    torch.ops.aten.to.device: _to,
    torch.ops.aten.to.dtype_layout: _to,
    torch.ops.aten.__and__.Tensor: lambda a, b: (torch.ops.aten.bitwise_and.Tensor, (a, b)),
}


def _inference_batch_norm(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """``batch_norm(training=False)`` (a batch norm that could not be folded) -> the
    ``_native_batch_norm_legit_no_training`` + ``getitem(0)`` pair of the decomposition."""
    x, weight, bias, mean, var, training, momentum, eps = node.args[:8]
    if training:
        return  # left to the decomposition (the public path)
    val = node.meta["val"]
    with graph.inserting_after(node):
        triple = graph.call_function(
            torch.ops.aten._native_batch_norm_legit_no_training.default,
            (x, weight, bias, mean, var, momentum, eps),
        )
    triple.meta = dict(node.meta)
    triple.meta["val"] = (val, val.new_empty((0,)), val.new_empty((0,)))
    with graph.inserting_after(triple):
        out = graph.call_function(operator.getitem, (triple, 0))
    _replace(graph, node, out)


def _replace(graph: torch.fx.Graph, old: torch.fx.Node, new: torch.fx.Node) -> None:
    """``new`` takes ``old``'s place, metadata and name (the program's signature names outputs)."""
    new.meta = dict(old.meta)
    old.replace_all_uses_with(new)
    name = old.name
    graph.erase_node(old)
    # an erased node's name stays taken in fx's namespace: ``_rename`` would make it
    # ``<name>_1``, and a graph output (a ConvTranspose last) then misses its output spec
    graph._graph_namespace._used_names.discard(name)
    new._rename(name)
    if new.name != name:
        raise RuntimeError(f"could not rename {new.name} to {name}")  # _fast: the public path


# custom ops of libraries that have an ONNX-exportable form, and how to select it
_OP_FIXES = {
    "transformers.grouped_mm": (
        "Hugging Face mixture-of-experts layers (Mixtral, Qwen2-MoE ...) run their experts "
        "through this op by default: load the model with experts_implementation='batched_mm' "
        "(from_pretrained(..., experts_implementation='batched_mm'), or the config's "
        "experts_implementation), whose stacked expert weights quantbridge quantizes per (expert, "
        "output channel); quantize again after the switch"
    ),
}


def _untranslated_ops(program: torch.export.ExportedProgram, message: str) -> str | None:
    """One line naming the op torch's translator found no ONNX function for (``DispatchError:
    No ONNX function found for <OpOverload(op='ns.name', ...)>``), the layers that call it
    and the fix; None for any other failure."""
    marker = "No ONNX function found for <OpOverload(op='"
    if marker not in message:
        return None
    op = message.split(marker, 1)[1].split("'", 1)[0]
    layers = []
    for node in program.graph.nodes:
        target = str(node.target)  # ns.name.overload
        if node.op == "call_function" and (target == op or target.startswith(op + ".")):
            stack = node.meta.get("nn_module_stack") or {}
            path = list(stack.values())[-1][0] if stack else node.name
            if path not in layers:
                layers.append(path)
    fix = next((v for k, v in _OP_FIXES.items() if op.startswith(k)), None)
    fix = fix or "write that computation with torch operators, or leave it out of the model"
    where = ", ".join(layers[:4]) + (" ..." if len(layers) > 4 else "")
    return (
        f"export: the op {op} (in {where or 'the model'}) has no ONNX translation in "
        f"torch.onnx; {fix}"
    )
