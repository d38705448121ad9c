"""Node names of an exported graph: the module path of the op, as its user wrote the model.

torch's exporter names nodes after its own counters (``node_conv2d_3``, ``node_QuantizeLinear_7``),
so everything that shows a node name (``quantbridge compare``'s layer column, ``inspect``, the
folded file's integer ops, ``lower``'s program and refusals) spoke in names the user never wrote.
Each node carries the module stack it was traced in (``pkg.torch.onnx.name_scopes``: the module
paths from the root, then the fx node, ``['', 'layer1', 'layer1.0', 'layer1.0.conv1',
'conv2d_1']``); ``name_nodes`` renames the nodes from it, before the metadata is stripped:

* an op of a module whose every op is of one kind and which holds no other module (a ``Conv2d``,
  a ``ReLU``): the module's path, ``layer1.0.conv1``; any other op: the module's path and the
  op, ``layer1.0.add`` (a functional add in a block), ``add`` at the top level;
* where one torch op became several ONNX nodes, the node computing the op's result keeps the
  name and the others add their type, ``fc.MatMul``;
* the nodes of a quantizer (``quantbridge.*`` ops) after the tensor they quantize: an
  activation's ``QuantizeLinear`` / ``Clip`` / ``DequantizeLinear`` after the node computing it,
  ``layer1.0.relu.output_q`` / ``_clip`` / ``_dq`` (a graph input's after the input, ``x_q``); a
  constant's ``DequantizeLinear`` after the op reading it and the input's role,
  ``layer1.0.conv1.weight_dq`` / ``.bias_dq`` (past the op's own layout nodes: a Linear's
  ``blocks.0.qkv.weight_dq``, not its Transpose's; ``.input<i>_dq`` for other ops);
* a model imported from ONNX: its layers are modules named after the file's nodes made python
  identifiers (``p2o_Conv_0``); ``modules`` (``OnnxModule.onnx_names``) maps them back to the
  file's own names (``p2o.Conv.0``);
* names are unique: a second use of a name (a module called twice) takes ``_1``, then ``_2``
  (torch's own convention for repeated calls); a node without the metadata keeps its name.

Only node names change: values keep theirs, because the export record
(``_record``: which ``QuantizeLinear`` output each quantizer call became), ``debug.compare``'s
pairing across engines and the fold (a ``QuantizeLinear`` output becomes its integer op's) all
key on value names.
"""

from __future__ import annotations

import ast
import re

import onnx

from .._graph_index import unique_name

_SCOPES = "pkg.torch.onnx.name_scopes"
_CLASSES = "pkg.torch.onnx.class_hierarchy"
_OURS = "quantbridge."  # the export ops' namespace (``quantbridge.torch._export_ops``)
_CALL_COUNTER = re.compile(r"_\d+$")  # fx's counter on repeated ops: ``conv2d_3``
_ROLES = {  # op -> input position -> role of a constant there
    "Conv": {1: "weight", 2: "bias"},
    "ConvTranspose": {1: "weight", 2: "bias"},
    "Gemm": {1: "weight", 2: "bias"},
    "MatMul": {1: "weight"},
    "Gather": {0: "weight"},
}
_LINEAR_BIAS = {"Add": {0: "bias", 1: "bias"}}  # nn.Linear on 3-d inputs: MatMul, then + bias
_LAYOUT = {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Cast"}  # between a weight and its op
_TAGS = {"QuantizeLinear": "q", "DequantizeLinear": "dq", "Clip": "clip"}


def name_nodes(model: onnx.ModelProto, modules: dict[str, str] | None = None) -> None:
    """Rename ``model``'s nodes after the module paths in their metadata (module docstring),
    in place. ``modules``: module path -> the name to show for it (an imported file's nodes)."""
    nodes = list(model.graph.node)
    scopes = {id(n): _scopes(n) for n in nodes}
    ours = {id(n) for n in nodes if _is_quantizer(n, scopes[id(n)])}
    names, bases = _module_names(nodes, scopes, ours, modules or {})
    used = {n.name for n in nodes if id(n) not in names and id(n) not in ours}
    for n in nodes:  # graph order: the first call keeps the plain name
        if id(n) in names:
            names[id(n)] = unique_name(names[id(n)], used)
    producer = {o: n for n in nodes for o in n.output if o}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    inputs = {v.name for v in model.graph.input}
    groups: dict[tuple, list[onnx.NodeProto]] = {}
    for n in nodes:
        if id(n) in ours:
            groups.setdefault(tuple(scopes[id(n)]), []).append(n)
    for group in groups.values():  # after the ops they read: ``layer1.0.relu_1.output_q``
        base = _quantizer_base(group, names, bases, producer, readers, inputs)
        for n in group:
            tag = _TAGS.get(n.op_type, n.op_type.lower())
            names[id(n)] = unique_name(f"{base}_{tag}", used) if base else unique_name(n.name, used)
    for n in nodes:
        if id(n) in names:
            n.name = names[id(n)]


def _scopes(node: onnx.NodeProto, key: str = _SCOPES) -> list[str] | None:
    """A node's list-valued metadata (the exporter writes python list literals)."""
    entry = next((p.value for p in node.metadata_props if p.key == key), None)
    if entry is None:
        return None
    try:
        found = ast.literal_eval(entry)
    except (ValueError, SyntaxError):
        return None
    ok = isinstance(found, list) and found and all(isinstance(s, str) for s in found)
    return found if ok else None


def _is_quantizer(node: onnx.NodeProto, scopes: list[str] | None) -> bool:
    """One of the nodes an export op of ours became (its class hierarchy ends with the op)."""
    classes = _scopes(node, _CLASSES)
    return scopes is not None and classes is not None and classes[-1].startswith(_OURS)


def _module_names(nodes, scopes, ours, modules: dict[str, str]) -> tuple[dict, dict]:
    """Node -> name for the nodes torch ops became (module docstring, first two cases), and
    node -> (the node computing its torch op's result, the op's kind)."""
    kinds: dict[str, set[str]] = {}  # module path -> kinds of the ops directly in it
    parents: set[str] = set()  # modules holding another module that holds a node
    calls: dict[tuple, list[onnx.NodeProto]] = {}
    for n in nodes:
        s = scopes[id(n)]
        if s is None:
            continue
        parents.update(s[:-2])
        if id(n) in ours:
            continue
        module = s[-2] if len(s) > 1 else ""
        kinds.setdefault(module, set()).add(_CALL_COUNTER.sub("", s[-1]))
        calls.setdefault(tuple(s), []).append(n)
    names, bases = {}, {}
    for s, group in calls.items():
        module, op = (s[-2] if len(s) > 1 else ""), _CALL_COUNTER.sub("", s[-1])
        shown = modules.get(module, module)
        if module and module not in parents and len(kinds[module]) == 1:
            base = shown
        else:
            base = f"{shown}.{op}" if shown else op
        result = [n for n in group if s[-1] in n.output]
        main = result[-1] if result else group[-1]
        for n in group:
            names[id(n)] = base if n is main else f"{base}.{n.op_type}"
            bases[id(n)] = (id(main), op)
    return names, bases


def _quantizer_base(group, names, bases, producer, readers, inputs) -> str | None:
    """The name a quantizer's nodes are named after: ``<producer>.output``, a graph input's
    name, or ``<reader>.<role>`` for a constant (module docstring; the reader past layout ops,
    a Linear's weight ``Transpose``)."""
    inside = {o for n in group for o in n.output}
    first = group[0].input[0] if group[0].input else ""
    if first in inputs:
        return first
    source = producer.get(first)
    if source is not None and source.output[0] not in inside:
        if id(source) in names:
            return f"{names[id(source)]}.output"
        return None  # computed by a node we do not name (no metadata)
    value = group[-1].output[0]  # a constant's dequantization: after the op reading it
    for _ in range(4):
        reader = next((r for r in readers.get(value, []) if id(r) in names), None)
        helper = reader is not None and id(reader) != bases[id(reader)][0]
        if not helper or reader.op_type not in _LAYOUT:  # follow an op's own layout nodes only
            break
        value = reader.output[0]
    if reader is None:
        return None
    position = list(reader.input).index(value)
    main, op = bases[id(reader)]
    role = _ROLES.get(reader.op_type, {}).get(position)
    if role is None and op == "linear":
        role = _LINEAR_BIAS.get(reader.op_type, {}).get(position)
    role = role or f"input{position}"
    return f"{names[main]}.{role}"  # the op's name, unique by now (``conv_1.bias``)
