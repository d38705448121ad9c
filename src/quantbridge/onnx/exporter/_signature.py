"""The call signature of an export, recorded in the ONNX file's metadata.

An ONNX graph only knows flat, named tensors. The user's model is called with args and kwargs
(tensors, nested tuples, plain values) and returns a structure (a tensor, a tuple, a dict, a
Hugging Face ``ModelOutput``). ``torch.export`` records both sides as pytree specs; this module
writes them next to the graph, under the metadata key ``quantbridge.signature``, as JSON:

* ``parameters``: ``[[name, kind], ...]`` of the traced ``forward`` (``inspect.Parameter`` kinds
  by name), so a later call can be bound by name as Python would bind it;
* ``in_spec`` / ``out_spec``: ``torch.utils._pytree.treespec_dumps`` of the call's
  ``(args, kwargs)`` and of the output (plain JSON: type names and keys, never a pickle);
* ``inputs``: one entry per input leaf, in flattening order: ``{"input": "<graph input>"}`` for a
  tensor, ``{"constant": value}`` for a plain value that the trace baked into the graph;
* ``outputs``: one entry per output leaf: ``{"output": i}`` (the i-th graph output) or
  ``{"constant": value}``;
* ``forward`` (a QuantModel's export): the user's own model's ``forward`` parameters with their
  defaults (``torch._positional.forward_parameters``), so positional calls of a model captured
  from keyword inputs bind as the user's model binds them.

The engine layer (``quantbridge.engine``) reads it to call the graph like the user's model.
"""

from __future__ import annotations

import json

import onnx
import torch
from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind, TensorArgument
from torch.utils import _pytree as pytree

from ...torch._positional import forward_parameters

SIGNATURE_KEY = "quantbridge.signature"


def _constant(value) -> dict:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return {"constant_repr": repr(value)}  # not comparable on a later call; shown in errors
    return {"constant": value}


def call_signature(program: torch.export.ExportedProgram, forward) -> dict:
    """The JSON-able record described in the module docstring."""
    params = [[name, kind] for name, kind, _ in forward_parameters(forward) or []]
    inputs = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        if isinstance(spec.arg, TensorArgument):
            inputs.append({"input": spec.arg.name})
        elif isinstance(spec.arg, ConstantArgument):
            inputs.append(_constant(spec.arg.value))
        else:  # a symbolic int input: not an ONNX graph input either
            inputs.append({"constant_repr": str(spec.arg)})
    outputs, index = [], 0
    for spec in program.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            continue
        if isinstance(spec.arg, TensorArgument):
            outputs.append({"output": index})
            index += 1
        else:
            outputs.append(_constant(getattr(spec.arg, "value", None)))
    record = {
        "parameters": params,
        "in_spec": pytree.treespec_dumps(program.call_spec.in_spec),
        "out_spec": pytree.treespec_dumps(program.call_spec.out_spec),
        "inputs": inputs,
        "outputs": outputs,
    }
    source = getattr(getattr(forward, "__self__", None), "__dict__", {}).get("_qb_source")
    parameters = None if source is None else forward_parameters(source.forward)
    if parameters is not None:
        record["forward"] = parameters
    return record


def record_signature(model: onnx.ModelProto, program: torch.export.ExportedProgram, forward):
    """Write ``call_signature`` into ``model.metadata_props`` (replacing an earlier one).

    A structure that pytree cannot serialise (a type registered without a serialized name) is
    left unrecorded: the engine layer then calls the graph by its input names.
    """
    try:
        text = json.dumps(call_signature(program, forward), sort_keys=True)
    except Exception:  # noqa: BLE001 - the signature is an aid; the export stands without it
        return
    for i in reversed(range(len(model.metadata_props))):
        if model.metadata_props[i].key == SIGNATURE_KEY:
            del model.metadata_props[i]
    entry = model.metadata_props.add()
    entry.key, entry.value = SIGNATURE_KEY, text
