"""The export record: metadata saying which quantizer became which ONNX scale initializer
(``debug.compare`` pairs a ``QuantModel``'s quantizer calls with the file's tensors by it)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ..._version import __version__
from ...torch._model import QuantModel
from ...torch._placement import CONTAINER
from ._merged_calls import pop_calls


def record_quantizers(model: onnx.ModelProto, qmodel: QuantModel) -> None:
    """Metadata: the recipe, and which quantizer became which ONNX scale initializer.

    The exporter merges equal constants: an activation quantizer whose step equals another's
    (a split group on the common grid, every hard-swish clamp's fixed 6/255 step) has its
    QuantizeLinear read the one initializer left of that value. Such a quantizer is recorded
    with that initializer when exactly one activation scale initializer holds its step (bitwise),
    so several quantizers may name one initializer (``debug.compare`` pairs their calls); its
    entry says ``"merged": true`` (the initializer is named after another quantizer).

    Each activation quantizer's ``"sites"``: the QuantizeLinear output each of its calls became,
    in the order of its calls (``_merged_calls``), ``""`` for a call left with none; the optimizer's
    merging of identical calls (Llama's per-layer rotary unsqueeze) made several calls, of one
    or several quantizers, one tensor."""
    names = {init.name for init in model.graph.initializer}
    steps = _activation_steps(model)
    container = getattr(qmodel, CONTAINER)
    calls = pop_calls(model)
    record = {}
    for p in qmodel.qb_points:
        sites = [calls[c] for c in _scale_names(p.attr) if c in calls]
        for cand in _scale_names(p.attr):
            if cand in names:
                record[p.name] = {"kind": p.kind, "scale": cand, "module": p.module}
                break
        else:
            q = getattr(container, p.attr)
            scale = q.current_scale() if p.kind == "activation" and q.enabled else None
            same = [] if scale is None or scale.numel() != 1 else steps.get(_bits(scale), [])
            if len(same) == 1:
                record[p.name] = {
                    "kind": p.kind, "scale": same[0], "module": p.module, "merged": True
                }  # fmt: skip
        if p.name in record and p.kind == "activation" and sites and any(sites[0]):
            # the QuantizeLinear of each call, in order; "" for a call the optimizer removed
            # with no survivor (a no-op slice of a shared grid's value, crossvit's x[:, 0:1]
            # of a full batch slice): the other calls keep their places
            record[p.name]["sites"] = sites[0]
    props = {
        "quantbridge.recipe": qmodel.qb_recipe.to_json(),
        "quantbridge.quantizers": json.dumps(record, sort_keys=True),
    }
    for k, v in props.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = k, v
    model.producer_name = "quantbridge"
    model.producer_version = __version__  # torch's exporter wrote its own version there


def _scale_names(attr: str) -> tuple[str, str]:
    return f"{CONTAINER}.{attr}.scale", f"{CONTAINER}.{attr}.export_scale"


def _bits(value) -> bytes:
    return np.asarray(
        value.detach().cpu() if torch.is_tensor(value) else value, np.float32
    ).tobytes()


def _activation_steps(model: onnx.ModelProto) -> dict[bytes, list[str]]:
    """One-element scale initializers of activation QuantizeLinear nodes (their input is not a
    constant), by their float32 bits."""
    inits = {i.name: i for i in model.graph.initializer}
    found: dict[bytes, list[str]] = {}
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] not in inits and n.input[1] in inits:
            arr = numpy_helper.to_array(inits[n.input[1]])
            names = found.setdefault(_bits(arr.reshape(-1)[:1]) if arr.size == 1 else b"", [])
            if arr.size == 1 and n.input[1] not in names:
                names.append(n.input[1])
    found.pop(b"", None)
    return found
