"""No back-to-back Q/DQ on one grid: ``DQ(s, z) -> [identity ops] -> Q(s, z)`` is dropped.

Placement quantizes an op's output even where the op is an identity on the values it gets:
an untrained ViT's ``cat([cls, patches]) + position_embeddings`` adds all-zero embeddings, and
the add's output quantizer calibrates to the same grid as the concat's. The export then wrote
``Concat -> Q -> DQ -> Add(0) -> Q -> DQ`` with one scale and zero point on both pairs, which
OpenVINO 2026.4 cannot compile (``compile_model(path)`` dies with SIGSEGV on HF DeiT, AST,
YOLOS, DPT, TimeSformer; ``passes/_openvino.openvino_crash_site``). The second pair rounds
nothing: for a per-tensor grid with step ``s`` and zero point ``z``, and a code ``q`` in the
type's range,

* ``Q(DQ(q)) == q``: ``DQ(q) = float32((q - z) * s)`` and ``Q`` divides by ``s`` in float32
  (or multiplies by ``float32(1 / s)``): a relative error of a few units of 2^-24 on an integer
  of at most 2^16, far inside ``rne``'s half step, so ``rne(.) + z == q`` and the clamp does
  nothing;
* ``x + 0``, ``x - 0``, ``x * 1``, ``x / 1`` and ``Identity`` return ``x`` exactly in IEEE
  arithmetic (``-0 + 0`` is ``+0``: the same number).

So the readers of the second QuantizeLinear read the first pair's codes instead, a second
DequantizeLinear of those codes with the same parameters is the first one (its readers read the
first one's output), and the identity ops, the second pair and the constants only they read go.
Every value the file computes is the same, bit for bit, in every engine that runs ONNX's
QuantizeLinear / DequantizeLinear arithmetic.

Applied where both nodes have constant, equal, per-tensor parameters (scale bits, zero point
value and type) and the ops between them are ``Identity`` or an ``Add`` / ``Sub`` of an all-zero
constant or a ``Mul`` / ``Div`` by an all-one constant (the constant second for ``Sub`` /
``Div``) whose shape broadcasts into the other operand's inferred shape without enlarging it
(a zero constant of a larger shape would broadcast the tensor: not an identity). The second
QuantizeLinear's output stays where it is a graph output.

The export's working note of which quantizer call became which QuantizeLinear
(``_merged_calls``) is updated: a call whose node went now names the first pair's QuantizeLinear,
which holds the same codes, so ``debug.compare`` still pairs both quantizers' calls.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference

from ._merged_calls import CALLS_KEY
from ._pad_codes import _params, _same

# ops that are the identity when their constant operand holds only this value (module docstring)
_IDENTITY_WITH = {"Add": 0.0, "Sub": 0.0, "Mul": 1.0, "Div": 1.0}
_DEPTH = 4  # identity ops between the two pairs


def drop_identity_requantize(model: onnx.ModelProto) -> int:
    """Rewrite ``model``'s main graph in place (module docstring); returns how many second
    Q/DQ pairs went."""
    graph = model.graph
    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    producer = {t: n for n in graph.node for t in n.output}
    outputs = {o.name for o in graph.output} | _read_in_subgraphs(graph)
    shapes: dict | None = None  # inferred on the first identity op with a constant
    renamed: dict[str, str] = {}  # a dropped tensor -> the tensor holding its values
    dropped: list[onnx.NodeProto] = []
    for q in graph.node:
        if q.op_type != "QuantizeLinear" or q.output[0] in outputs:
            continue
        q_params = _params(consts, q)
        if q_params is None:
            continue
        path, t = [], q.input[0]
        while len(path) <= _DEPTH:
            node = producer.get(t)
            if node is None or node.op_type == "DequantizeLinear":
                break
            if node.op_type != "Identity" and node.op_type not in _IDENTITY_WITH:
                node = None
                break
            if node.op_type != "Identity" and shapes is None:
                shapes = _inferred_shapes(model)
            if node.op_type != "Identity" and not _identity(node, consts, shapes or {}):
                node = None
                break
            path.append(node)
            t = node.input[0]
        dq = producer.get(t)
        if dq is None or dq.op_type != "DequantizeLinear" or len(path) > _DEPTH:
            continue
        dq_params = _params(consts, dq)
        if dq_params is None or not _same(dq_params, q_params):
            continue
        renamed[q.output[0]] = renamed.get(dq.input[0], dq.input[0])
        dropped.append(q)
    if not dropped:
        return 0
    _rewire(graph, renamed)
    merged = _merge_duplicate_dequantize(graph, consts, outputs, renamed)
    _remove_dead(graph, dropped + merged, outputs)
    _rename_calls(model, renamed)
    return len(dropped)


def _identity(node: onnx.NodeProto, consts: dict, shapes: dict) -> bool:
    """Whether ``node`` (Add / Sub / Mul / Div) returns its first input unchanged: the second a
    constant of 0 (1), whose shape broadcasts into the first's inferred shape."""
    if len(node.input) != 2 or node.input[1] not in consts or node.input[0] in consts:
        return False
    value = consts[node.input[1]]
    if value.size == 0 or not np.all(value == _IDENTITY_WITH[node.op_type]):
        return False
    shape = shapes.get(node.input[0])
    if shape is None or value.ndim > len(shape):
        return False
    tail = shape[len(shape) - value.ndim :]
    return all(c == 1 or c == d for c, d in zip(value.shape, tail, strict=True))


def _inferred_shapes(model: onnx.ModelProto) -> dict[str, list]:
    """Tensor -> its inferred dimensions (an int, or None where not a fixed number)."""
    try:
        inferred = shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001  (no shapes: no identity op qualifies)
        return {}
    found = {}
    for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        t = v.type.tensor_type
        if t.HasField("shape"):
            found[v.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    return found


def _read_in_subgraphs(graph: onnx.GraphProto) -> set[str]:
    """Names the subgraphs of ``graph``'s nodes (If / Loop bodies) read: kept as they are, like
    graph outputs."""
    found: set[str] = set()
    for n in graph.node:
        for a in n.attribute:
            for g in [a.g] if a.HasField("g") else list(a.graphs):
                found |= {t for m in g.node for t in m.input} | _read_in_subgraphs(g)
    return found


def _rewire(graph: onnx.GraphProto, renamed: dict[str, str]) -> None:
    for n in graph.node:
        for i, t in enumerate(n.input):
            if t in renamed:
                n.input[i] = renamed[t]


def _merge_duplicate_dequantize(
    graph: onnx.GraphProto, consts: dict, outputs: set[str], renamed: dict[str, str]
) -> list[onnx.NodeProto]:
    """A DequantizeLinear that now reads the same codes with the same parameters as another:
    its readers read the other's output; returns those nodes (the second pairs' DQs)."""
    first: dict[str, tuple[onnx.NodeProto, tuple]] = {}
    alias: dict[str, str] = {}
    merged = []
    targets = set(renamed.values())
    for n in graph.node:
        if n.op_type != "DequantizeLinear" or n.input[0] not in targets:
            continue
        params = _params(consts, n)
        if params is None:
            continue
        seen = first.get(n.input[0])
        if seen is None:
            first[n.input[0]] = (n, params)
        elif _same(seen[1], params) and n.output[0] not in outputs:
            alias[n.output[0]] = seen[0].output[0]
            merged.append(n)
    _rewire(graph, alias)
    renamed.update(alias)
    return merged


def _remove_dead(graph: onnx.GraphProto, dropped: list[onnx.NodeProto], outputs: set[str]):
    """Remove nodes nothing reads (the dropped QuantizeLinears, then what only they read), and
    the initializers no node reads any more among theirs."""
    read = {t for n in graph.node for t in n.input}
    candidates = {id(n) for n in dropped}
    inputs_of_removed: set[str] = set()
    changed = True
    while changed:
        changed = False
        for n in list(graph.node):
            dead = not any(t in read or t in outputs for t in n.output)
            if not dead or (id(n) not in candidates and not _fed(n, inputs_of_removed)):
                continue
            graph.node.remove(n)
            inputs_of_removed.update(n.input)
            read = {t for m in graph.node for t in m.input}
            changed = True
    for init in [i for i in graph.initializer if i.name in inputs_of_removed - read]:
        graph.initializer.remove(init)


def _fed(node: onnx.NodeProto, inputs_of_removed: set[str]) -> bool:
    """Whether ``node`` computed an input of a removed node (it may go when nothing else reads
    it)."""
    return any(t in inputs_of_removed for t in node.output)


def _rename_calls(model: onnx.ModelProto, renamed: dict[str, str]) -> None:
    for prop in model.metadata_props:
        if prop.key == CALLS_KEY:
            calls = json.loads(prop.value)
            for outs in calls.values():
                outs[:] = [_final(renamed, o) for o in outs]
            prop.value = json.dumps(calls)


def _final(renamed: dict[str, str], name: str) -> str:
    while name in renamed:
        name = renamed[name]
    return name
