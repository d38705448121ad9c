"""The graph input and output names of an export: an imported file's own, else the user's.

``torch.export`` names graph inputs after ``forward``'s parameters, made python identifiers
(``input.1`` -> ``input_1``, ``extra:0`` -> ``extra_0``; ``input`` becomes ``input_1`` because
it shadows a builtin), and graph outputs after the last op (``add``, ``conv2d``). A model that
came from ``qb.import_onnx`` carries the file's names (``OnnxModule.qb_io_names``, recorded by
``qb.quantize`` in ``qb_capture["io_names"]``); ``keep_source_names`` renames the exported
graph's inputs and outputs back to them, with the call signature in the metadata
(``_signature``) that the engine layer reads. Any other torch model gets the names its user
knows (``user_names``): ``forward``'s parameters for the inputs, ``output`` / ``output_0`` / the
dict's keys for the outputs.

The pairing follows the recorded signature, not list positions: the i-th input leaf of the
export call is the i-th positional parameter, or the keyword it was passed as; the k-th output
leaf is the k-th graph output of the file. A value of the exported graph that already holds a
wanted name (an internal ``add``) is renamed out of the way first (``<name>__<n>``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import onnx
from torch.utils import _pytree as pytree

from ._signature import SIGNATURE_KEY


def io_names_of(module) -> dict | None:
    """The recorded ONNX names of ``module`` (a QuantModel or an imported float model)."""
    capture = getattr(module, "qb_capture", None) or {}
    return capture.get("io_names") or getattr(module, "qb_io_names", None)


def keep_source_names(model: onnx.ModelProto, io_names: dict | None) -> None:
    """Rename ``model``'s graph inputs and outputs to ``io_names`` (module docstring), in place."""
    entry = next((p for p in model.metadata_props if p.key == SIGNATURE_KEY), None)
    if entry is None:
        return
    signature = json.loads(entry.value)
    _match_graph_inputs(model.graph, signature)
    io_names = io_names or user_names(signature)
    if not io_names:
        return
    mapping = _input_mapping(signature, io_names) | _output_mapping(model, signature, io_names)
    mapping = rename_values(model.graph, mapping)
    if not mapping:
        return
    for leaf in signature["inputs"]:
        if "input" in leaf:
            leaf["input"] = mapping.get(leaf["input"], leaf["input"])
    entry.value = json.dumps(signature, sort_keys=True)


def rename_values(graph: onnx.GraphProto, mapping: dict[str, str]) -> dict[str, str]:
    """Rename each old name in ``mapping`` to its new one in ``graph``, in place; a value that
    already holds a wanted name is renamed out of the way first (``<name>__<n>``). The renaming
    done (empty, and ``graph`` unchanged, when ``mapping`` asks for one name twice or for "")."""
    mapping = {old: new for old, new in mapping.items() if old != new}
    wanted = set(mapping.values())
    if not mapping or len(wanted) != len(mapping) or "" in wanted:
        return {}
    kept = set(mapping)
    taken = set(_all_names(graph))
    for name in sorted(wanted & (taken - kept)):  # an internal value holding a wanted name
        n = 0
        while f"{name}__{n}" in taken:
            n += 1
        mapping[name] = f"{name}__{n}"
        taken.add(mapping[name])
    _rename(graph, mapping)
    return mapping


def _match_graph_inputs(graph: onnx.GraphProto, signature: dict) -> None:
    """Point the signature's input leaves at the graph's inputs, in order, when the names it
    recorded are not the graph's: torch's exporter named the input of a model imported from a
    float16 file (ModelOpt's default) ``arg_0`` while the signature kept ``x``, so the file's
    name was never restored."""
    stored = {i.name for i in graph.initializer}
    actual = [i.name for i in graph.input if i.name not in stored]
    leaves = [leaf for leaf in signature["inputs"] if "input" in leaf]
    if len(leaves) == len(actual) and any(leaf["input"] not in actual for leaf in leaves):
        for leaf, name in zip(leaves, actual, strict=True):
            leaf["input"] = name


_NAMED_KINDS = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")


def user_names(signature: dict) -> dict | None:
    """The names a torch model's user knows, as ``io_names``: inputs after ``forward``'s
    parameters (``input``, not torch.export's ``input_1``), outputs ``output`` for one tensor,
    ``output_0``, ``output_1``, ... for a tuple or list, the keys for a dict (not the last op's
    ``linear`` or ``quantize_dequantize_1``). None for an output structure of other kinds."""
    params = signature.get("forward") or signature.get("parameters") or []
    names = [p[0] for p in params if p[1] in _NAMED_KINDS]
    try:
        spec = pytree.treespec_loads(signature["out_spec"])
    except Exception:  # noqa: BLE001 - an unreadable spec: keep the exporter's names
        return None
    outputs = _output_names(spec)
    return None if outputs is None else {"inputs": [[n, n] for n in names], "outputs": outputs}


def _output_names(spec) -> list[str] | None:
    if spec.is_leaf():
        return ["output"]
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    if not all(child.is_leaf() for child in children):
        return None  # nested structures keep the exporter's names
    if spec.type in (tuple, list):
        return [f"output_{i}" for i in range(len(children))]
    keys = list(spec.context or []) if spec.type is dict else []
    if len(keys) == len(children) and all(isinstance(k, str) and k for k in keys):
        return keys
    return None


def _input_mapping(signature: dict, io_names: dict) -> dict[str, str]:
    pairs = [tuple(p) for p in io_names["inputs"]]
    try:
        spec = pytree.treespec_loads(signature["in_spec"])
        # ``children()`` where torch has it (``children_specs`` warns in torch 2.13), else that
        args_spec, kwargs_spec = (
            spec.children() if hasattr(spec, "children") else spec.children_specs
        )
    except Exception:  # noqa: BLE001 - an unreadable spec: keep the exporter's names
        return {}
    keys = list(kwargs_spec.context or [])
    n_args = args_spec.num_children
    if n_args > len(pairs) or n_args + len(keys) != len(signature["inputs"]):
        return {}
    by_parameter = dict(pairs)
    users = [pairs[i][1] for i in range(n_args)] + [by_parameter.get(k) for k in keys]
    return {
        leaf["input"]: user
        for leaf, user in zip(signature["inputs"], users, strict=True)
        if "input" in leaf and user
    }


def _output_mapping(model: onnx.ModelProto, signature: dict, io_names: dict) -> dict[str, str]:
    leaves, wanted = signature["outputs"], io_names["outputs"]
    graph_inputs = {v.name for v in model.graph.input}
    outputs = [v.name for v in model.graph.output]
    if len(leaves) != len(wanted) or any("output" not in leaf for leaf in leaves):
        return {}
    olds = [outputs[leaf["output"]] for leaf in leaves]
    if len(set(olds)) != len(olds) or graph_inputs & set(olds):
        return {}  # one value returned twice, or an input returned as is: keep them
    return dict(zip(olds, wanted, strict=True))


def _all_names(graph: onnx.GraphProto) -> Iterator[str]:
    yield from (v.name for v in (*graph.input, *graph.output, *graph.value_info))
    yield from (i.name for i in graph.initializer)
    for node in graph.node:
        yield from node.input
        yield from node.output
        for attr in node.attribute:
            for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                yield from _all_names(sub)


def _rename(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Every use of each old name in ``graph`` and its subgraphs (which see the outer names)."""
    for v in (*graph.input, *graph.output, *graph.value_info, *graph.initializer):
        v.name = mapping.get(v.name, v.name)
    for node in graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        node.output[:] = [mapping.get(n, n) for n in node.output]
        for attr in node.attribute:
            for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                _rename(sub, mapping)
