"""How a torch ``QuantModel``'s activation quantizers map onto the sites of its ONNX file
(``_match`` finds the sites; this module pairs each with the quantizer calls that made it).

Read from records, never guessed: quantbridge's export record (metadata ``quantbridge.quantizers``:
each quantizer's scale initializer and the ``QuantizeLinear`` outputs its calls became), else, for
a model imported from ONNX, the float tensor a site's ``QuantizeLinear`` reads.
"""

from __future__ import annotations

import json

import onnx

from ._match import QUANTIZERS_KEY, Site


def match_quantizers(
    sites: list[Site], points: list, scale_of: dict[str, str]
) -> dict[str, tuple[tuple[str, ...], int]]:
    """Site name -> (the activation quantizers of a ``QuantModel`` whose calls it is, which of
    their calls in execution order).

    With quantbridge's export record (``scale_of``: quantizer name -> scale initializer): the
    quantizers whose recorded scale initializer the site reads; the k-th site reading it (graph
    order) is the k-th of their calls in a forward pass (a shared quantizer, a Reshape's
    requantization). The record names values, not graph positions, so it holds where the exporter
    renamed the fx values: ``Recipe.split_ranges`` adds a conv per channel group, and the re-traced
    graph numbers ``conv2d_4`` ... differently from the QuantModel's own fx names, which paired a
    split copy with another conv's tensor. Where the exporter merged equal initializers (a split
    group on the common grid; every hard-swish clamp's fixed 6/255 step), the record names the
    merged initializer for each of its quantizers, and their calls are taken together, in the
    order the forward pass makes them (``TorchCapture`` pairs them only where the counts agree).

    Without a record of this model (most of its quantizers unnamed there: a model imported from
    ONNX, or a file the QuantModel was not exported to):
    the quantizer named after the float tensor the site's QuantizeLinear reads
    (``QuantPoint.name``, an imported model), else the quantizer reading the fx value of that
    name (``QuantPoint.tensor``), first call."""
    acts = [p for p in points if p.kind == "activation"]
    by_tensor = {p.tensor: p.attr for p in acts}
    by_name = {p.name: p.attr for p in acts}
    owners: dict[str, list[str]] = {}
    for p in acts:
        if p.name in scale_of:
            owners.setdefault(scale_of[p.name], []).append(p.attr)
    found: dict[str, tuple[tuple[str, ...], int]] = {}
    if 2 * sum(p.name in scale_of for p in acts) > len(acts):  # the record describes this model
        calls: dict[str, int] = {}
        for s in sites:
            attrs = owners.get(s.scale_init)
            if attrs:
                found[s.name] = (tuple(attrs), calls.get(s.scale_init, 0))
                calls[s.scale_init] = calls.get(s.scale_init, 0) + 1
        return found
    used = set()
    for s in sites:
        attr = by_name.get(s.source) or by_tensor.get(s.source)
        if attr is not None and attr not in used:
            found[s.name] = ((attr,), 0)
            used.add(attr)
    return found


def recorded_calls(sites: list[Site], points: list, model: onnx.ModelProto) -> dict:
    """Site name -> ((quantizer attribute,), which of its calls), from the export record's
    ``"sites"`` (the QuantizeLinear each call of a quantizer became, ``onnx/exporter/
    _merged_calls``): exact where the optimizer merged identical calls into one tensor (Llama's
    per-layer rotary ``cos.unsqueeze(1)``, four calls, three tensors), which the scale
    initializer's call count cannot pair. The first call of a merged tensor is taken (the
    others computed the same values)."""
    record = {}
    for prop in model.metadata_props:
        if prop.key == QUANTIZERS_KEY:
            record = json.loads(prop.value)
    names = {s.name for s in sites}
    found: dict[str, tuple[tuple[str, ...], int]] = {}
    for p in points:
        for k, site in enumerate(record.get(p.name, {}).get("sites", ())):
            if p.kind == "activation" and site in names and site not in found:
                found[site] = ((p.attr,), k)
    return found


def quantizer_scales(model: onnx.ModelProto) -> dict[str, str]:
    """Quantizer name -> scale initializer, from quantbridge's export record."""
    for prop in model.metadata_props:
        if prop.key == QUANTIZERS_KEY:
            return {k: v["scale"] for k, v in json.loads(prop.value).items()}
    return {}
