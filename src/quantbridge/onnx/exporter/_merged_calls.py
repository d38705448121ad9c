"""Which quantizer call became which ``QuantizeLinear`` of the optimized file.

Before torch's ONNX optimizer runs, every quantizer call of the trace is its own
``QuantizeLinear``, reading that quantizer's own scale initializer, in the order the forward pass
makes the calls. The optimizer's common-subexpression elimination then merges identical
computations: Llama's per-layer rotary ``cos.unsqueeze(1)`` and its quantizer, four calls
of four quantizers, became three ``QuantizeLinear`` in the file (``debug.compare``'s torch-quant
left 6 of 133 tensors unmatched with ``dynamic="all"``). ``quantize_calls`` reads, before the
optimizer, each such node's output name and a key of what it computes (op, attributes and
inputs' keys; small constants by value, as the optimizer compares them, large ones and graph
inputs by name); ``calls_after`` maps each call to the node left in the optimized graph: its own
output where it survived, else the surviving node with the same key. The export record keeps
the result per quantizer (``_record``: ``"sites"``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

_SMALL = 64  # constants up to this many elements are compared by value
CALLS_KEY = "quantbridge.quantize_calls"  # the export's working note, read by ``_record``


def quantize_calls(graph: Any) -> list[tuple[str, str, str]]:
    """(scale initializer, output name, key) of each QuantizeLinear of an onnxscript IR
    ``graph`` whose scale is an initializer, in graph order; [] if the IR is not as expected.
    Keys are computed node by node in the graph's (topological) order: no recursion."""
    try:
        keys: dict[int, str] = {}
        found = []
        for node in graph:
            ins = [_key(v, keys) if v is not None else "" for v in node.inputs]
            attrs = sorted((k, repr(a.value)) for k, a in node.attributes.items())
            for i, out in enumerate(node.outputs):
                if node.op_type == "Constant":  # by its value, in _key (or its own name)
                    continue
                text = f"{node.domain}::{node.op_type} {attrs} {ins} #{i}"
                keys[id(out)] = hashlib.sha1(text.encode()).hexdigest()
            if node.op_type != "QuantizeLinear" or node.domain not in ("", "ai.onnx"):
                continue
            scale = node.inputs[1]
            if scale is None or scale.const_value is None or not scale.name:
                continue
            found.append((scale.name, node.outputs[0].name, keys[id(node.outputs[0])]))
        return found
    except (AttributeError, TypeError, ValueError):  # another onnxscript: no record
        return []


def calls_after(before: list[tuple[str, str, str]], names: set[str]) -> dict[str, list[str]]:
    """Scale initializer (as traced) -> the output name in the optimized graph (``names``: the
    QuantizeLinear outputs there) of each of its calls, in order; a call whose node is gone
    with no survivor of the same key is ``""``."""
    survivor: dict[str, str] = {}
    for _, out, key in before:
        if out in names:
            survivor.setdefault(key, out)
    calls: dict[str, list[str]] = {}
    for scale, out, key in before:
        calls.setdefault(scale, []).append(out if out in names else survivor.get(key, ""))
    return calls


def _key(value: Any, keys: dict[int, str]) -> str:
    """The key of a node's input: its producer's (computed before, in graph order), else a
    small constant's value, else its name (a graph input, a large initializer)."""
    got = keys.get(id(value))
    if got is not None:
        return got
    const = value.const_value
    if const is not None and getattr(const, "size", _SMALL + 1) <= _SMALL:
        arr = const.numpy()
        text = f"const {arr.dtype} {arr.shape} {arr.tobytes().hex()}"
    else:
        text = f"value {value.name}"
    got = hashlib.sha1(text.encode()).hexdigest()
    keys[id(value)] = got
    return got


def pop_calls(model: Any) -> dict[str, list[str]]:
    """``calls_after``'s result, as ``export_program`` noted it on ``model``; the note is
    removed (it is not part of the file)."""
    props = model.metadata_props
    for i, prop in enumerate(props):
        if prop.key == CALLS_KEY:
            value = prop.value
            del props[i]
            return json.loads(value)
    return {}
