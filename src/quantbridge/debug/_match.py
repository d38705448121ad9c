"""The quantized tensors of a model ("sites") and how each engine's names map onto them.

A site is one quantized tensor of the reference ONNX file (QDQ or QOperator form), in the graph's
topological order: the output of a ``QuantizeLinear`` (of the Clip of its codes where that Clip is
their only reader: sub-8-bit Q -> Clip -> DQ) or of an integer op (``QLinearConv``,
``QGemm``, ... ``optables.QOPERATOR_OUTPUT_QPARAMS`` says where its output scale is), with that
scale and zero point. Non-quantized graph outputs are sites too (no scale). The mapping is read
from records, never guessed from name suffixes:

* ONNX engines on the QDQ file, and ONNX Runtime on the folded file: the site's own name. The
  fold keeps every ``QuantizeLinear`` output name as the output of the integer op that replaces
  it (``val_1`` is the Q output in QDQ form and the ``QLinearConv`` output after ``fold``);
* the integer program: ``IntegerProgram.onnx_tensors`` (ONNX name -> program tensor, recorded by
  the lowering);
* a torch ``QuantModel``: its placement record (``qb_points``). An exported model's metadata
  ``quantbridge.quantizers`` names each quantizer's scale initializer; a model imported from ONNX
  names each activation quantizer after the float tensor its ``QuantizeLinear`` reads (``source``);
* a float ONNX model: the float tensor the site's ``QuantizeLinear`` reads (``source``); tools
  that quantize an ONNX file (``quantize_onnx``, ONNX Runtime's) keep the float model's names.

A second quantized file is matched by site name, then by ``source``; what stays unmatched is
reported and the rest is compared.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
from onnx import numpy_helper

from ..onnx._weight_only import weight_only_readers
from ..optables import (
    FUSED_DYNAMIC_OPS,
    GROUP_WISE_OPS,
    QOPERATOR_OUTPUT_QPARAMS,
    UNIT_GAIN_OPS,
)
from ._gain import (
    conv_weight,
    elementwise_gain,
    linear_weight,
    product,
    product_at,
    two_site_chain,
    weighted_output,
)
from ._gain_norm import masked_where, norm_at, norm_of
from ._gain_output import weighted_sum_output

QUANTIZERS_KEY = "quantbridge.quantizers"


@dataclass(frozen=True)
class Site:
    """One quantized tensor (or float graph output) of the reference model."""

    name: str  # tensor name in the reference ONNX file (the integer codes)
    order: int  # topological position among the sites
    op: str  # op computing it (the producer of a QuantizeLinear's input), or "input"
    layer: str  # quantizer name from the export record, else the ONNX node name
    scale: float | None  # the step (None: float tensor, or a per-channel activation)
    zero_point: int
    elem_type: int  # ONNX element type of the codes (FLOAT for a float site)
    source: str = ""  # float tensor a QuantizeLinear reads ("" for integer ops)
    scale_init: str = ""  # initializer holding the scale
    aliases: tuple[str, ...] = ()  # DequantizeLinear outputs of the same values (graph outputs)
    inputs: tuple[str, ...] = ()  # the sites it is computed from (through float ops)
    unit_gain: bool = False  # every op from those sites to it is in optables.UNIT_GAIN_OPS
    factors: tuple[str, ...] = ()  # a Mul of two sites, read straight from their DequantizeLinear
    matmul: bool = False  # the factors are multiplied by a MatMul, not element by element
    # a MatMul / Gemm of one site (factors[0]) by a constant: W ([K, N], signed), ``_gain.linear_weight``
    weight: np.ndarray | None = field(default=None, compare=False, repr=False)
    # ... or a Conv / ConvTranspose of it: its attributes, ``weight`` the W (``_gain.conv_weight``)
    conv: dict | None = field(default=None, compare=False, repr=False)
    # a float output (W1 x1 +- W2 x2) * c of two weighted ops: per factor (c W, conv attributes)
    terms: tuple | None = field(default=None, compare=False, repr=False)
    # g(u) * h(v) / g(u) +- h(v) of two sites (factors): per side (g over u's codes or None,
    # its slope, u's grid), and the combining op (``_gain.two_site_chain``)
    chains: tuple | None = field(default=None, compare=False, repr=False)
    combine: str = ""
    # a LayerNormalization or Softmax of one site (factors[0]): ``_gain_norm.norm_of``
    norm: dict | None = field(default=None, compare=False, repr=False)
    gain: float | None = None  # a Mul or Div of one site by a constant: the largest |factor|;
    # an elementwise chain of one site (GELU, SiLU, Exp ...): its slope bound (``_gain``)

    @property
    def quantized(self) -> bool:
        return self.elem_type != onnx.TensorProto.FLOAT


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    found = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].HasField("t"):
            found[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return found


def quantizer_names(model: onnx.ModelProto) -> dict[str, str]:
    """Scale initializer -> quantizer name, from quantbridge's export record (empty if none):
    the quantizer it is named after, not those whose equal step the exporter merged into it."""
    for prop in model.metadata_props:
        if prop.key == QUANTIZERS_KEY:
            record = json.loads(prop.value)
            return {
                v["scale"]: k
                for k, v in record.items()
                if v.get("kind") == "activation" and not v.get("merged")
            }
    return {}


def has_weight_only_weights(model: onnx.ModelProto) -> bool:
    """Weight-only quantization: group-wise weights (a DequantizeLinear with ``block_size``,
    ONNX Runtime's ``MatMulNBits`` / ``GatherBlockQuantized``), or integer weights read by
    DequantizeLinear in a model that quantizes no activation (NNCF's ``compress_weights`` INT8,
    ``onnx._weight_only``). Such a file may have no quantized activation: ``compare`` then
    compares its outputs (float, in absolute units)."""
    blocked = any(
        n.op_type in GROUP_WISE_OPS
        or (
            n.op_type == "DequantizeLinear"
            and any(a.name == "block_size" and a.i for a in n.attribute)
        )
        for n in model.graph.node
    )
    return blocked or bool(weight_only_readers(model))


def find_sites(model: onnx.ModelProto) -> list[Site]:
    """Every quantized tensor of ``model`` (QDQ or QOperator form) and its float graph outputs,
    in topological order. ValueError for a model with no quantized tensor."""
    graph = model.graph
    consts = _constants(graph)
    producer = {o: n for n in graph.node for o in n.output}
    names = quantizer_names(model)
    sites: dict[str, Site] = {}
    aliases: dict[str, list[str]] = {}
    seen_scales: set[str] = set()
    weights = _constant_valued(graph, consts)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    clipped: dict[str, onnx.NodeProto] = {}  # a Clip's output site -> its QuantizeLinear
    for node in graph.node:
        slots = QOPERATOR_OUTPUT_QPARAMS.get(node.op_type)
        if node.op_type == "QuantizeLinear" and node.input[0] in weights:
            continue  # a weight quantized at run time (ModelOpt): codes, not an activation
        if slots is not None and node.output[0] not in consts:
            site = _site(node, slots, consts, producer, names, len(sites), seen_scales)
            clip = _code_clip(node, consumers)
            if site is not None and clip is not None:  # Q -> Clip -> DQ: the clipped codes
                site = replace(site, name=clip.output[0])
                clipped[site.name] = node
            if site is not None:
                sites[site.name] = site
        elif node.op_type == "DynamicQuantizeLinear":
            site = _dynamic_site(node, producer, len(sites))
            sites[site.name] = site
        elif node.op_type == "DequantizeLinear" and node.input[0] in sites:
            aliases.setdefault(node.input[0], []).append(node.output[0])
    fused = [
        f"{n.op_type} {n.name or n.output[0]!r}"
        for n in graph.node
        if n.op_type in FUSED_DYNAMIC_OPS
    ]
    if not sites and fused:
        raise ValueError(
            f"{graph.name or 'the model'} is dynamically quantized ({', '.join(fused[:3])}"
            f"{', ...' if len(fused) > 3 else ''}: ONNX Runtime's quantize_dynamic, fused by its "
            "graph optimisations): each op quantizes its input with a scale computed at run time "
            "and its codes are no tensor of the file, so compare has no quantized tensor to match. "
            "Compare quantize_dynamic's own output (saved before graph optimisations: "
            "DynamicQuantizeLinear -> MatMulInteger, which compare matches), or a statically "
            "quantized file (`quantbridge quantize FLOAT.onnx --calib CALIB.npz`)"
        )
    if not sites and not has_weight_only_weights(model):  # weight-only: the outputs are compared
        raise ValueError(
            f"{graph.name or 'the model'}: no quantized tensor (no QuantizeLinear, "
            "DynamicQuantizeLinear or QLinear* op); compare needs a quantized model, e.g. from qb.quantize + qb.export"
        )
    nodes = {n.output[0]: n for n in graph.node if n.output} | clipped
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
    out = []
    for s in sites.values():
        node = nodes[s.name]
        inputs, unit_gain = _upstream(node, sites, producer)
        known = {"inputs": inputs, "unit_gain": unit_gain}
        # a product, else a chain of elementwise ops of one site (GELU, Sigmoid ...): its slope
        known.update(
            product(node, producer, lambda t: _operand(t, sites, producer, consts))
            or elementwise_gain(node, sites, producer, consts, opset)
            or linear_weight(node, producer, lambda t: _operand(t, sites, producer, consts))
            or conv_weight(node, producer, lambda t: _operand(t, sites, producer, consts))
            or two_site_chain(node, sites, producer, consts, opset)
            or norm_of(node, producer, lambda t: _operand(t, sites, producer, consts), opset)
        )
        out.append(Site(**{**s.__dict__, "aliases": tuple(aliases.get(s.name, ())), **known}))
    held = {s.name for s in out} | {a for s in out for a in s.aliases}
    for o in graph.output:
        if o.name not in held:
            p = producer.get(o.name)
            op, layer = (p.op_type, p.name) if p is not None else ("input", o.name)
            ins, gain = _upstream(p, sites, producer) if p is not None else ((), False)
            operand = lambda t: _operand(t, sites, producer, consts)  # noqa: E731
            credit = (
                norm_at(o.name, producer, operand, opset)
                or weighted_output(o.name, producer, operand)
                or product_at(o.name, producer, operand)
                or weighted_sum_output(o.name, producer, operand)
            )
            out.append(
                Site(o.name, len(out), op, layer, None, 0, onnx.TensorProto.FLOAT,
                     inputs=ins, unit_gain=gain, **credit)
            )  # fmt: skip
    return out


def _code_clip(node: onnx.NodeProto, consumers: dict) -> onnx.NodeProto | None:
    """The Clip of a QuantizeLinear's codes that is their only reader (sub-8-bit QCDQ: Brevitas,
    QONNX's Quant): the site is the clipped codes, what the DequantizeLinear and torch read."""
    users = consumers.get(node.output[0], [])
    if node.op_type != "QuantizeLinear" or len(users) != 1 or users[0].op_type != "Clip":
        return None
    return users[0]


def _constant_valued(graph: onnx.GraphProto, consts: dict) -> set[str]:
    """Tensors computed from constants alone (a float weight, or its Transpose / Cast, that a
    QuantizeLinear quantizes at run time), in the graph's topological order."""
    found = set(consts)
    for n in graph.node:
        if n.input and all(not t or t in found for t in n.input):
            found.update(n.output)
    return found


def _upstream(
    node: onnx.NodeProto, sites: dict, producer: dict, limit: int = 256
) -> tuple[tuple[str, ...], bool]:
    """The sites ``node`` is computed from: walk its inputs back through float ops (and ops on
    codes between a site and its DequantizeLinear), stopping at sites (and DequantizeLinear of
    a site); constants and graph inputs end a path. Also
    whether ``node`` and every op walked through is in ``UNIT_GAIN_OPS``."""
    found: list[str] = []
    unit_gain = node.op_type in UNIT_GAIN_OPS
    todo = [t for t in node.input if t]
    seen: set[str] = set()
    while todo and len(seen) < limit:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in sites and t != node.output[0]:
            found.append(t)
            continue
        p = producer.get(t)
        if p is None or p.op_type == "QuantizeLinear":
            continue
        if p.op_type == "DequantizeLinear":
            if p.input[0] in sites:
                found.append(p.input[0])
            else:  # codes moved by an op on codes (Q -> Pad -> DQ: Swin's PatchMerging)
                todo.append(p.input[0])
            continue
        if masked_where(p, producer, sites):  # each element one branch's (unit gain)
            todo.extend(i for i in p.input[1:] if i)
            continue
        unit_gain = unit_gain and p.op_type in UNIT_GAIN_OPS
        todo.extend(i for i in p.input if i)
    return tuple(dict.fromkeys(found)), unit_gain


def _operand(t: str, sites: dict, producer: dict, consts: dict) -> str | np.ndarray | None:
    """A site's name (its DequantizeLinear's output), a constant's value, or None."""
    if t in consts:
        return np.asarray(consts[t])
    p = producer.get(t)
    if p is None or p.op_type != "DequantizeLinear":
        return None
    if p.input[0] in sites:
        return p.input[0]
    q = consts.get(p.input[0])
    scale = consts.get(p.input[1])
    zp = consts.get(p.input[2]) if len(p.input) > 2 and p.input[2] else None
    if q is None or scale is None:
        return None
    zero = np.zeros_like(scale, np.float64) if zp is None else zp.astype(np.float64)
    if scale.size > 1:  # per-channel: scale and zero point along the node's axis
        axis = next((a.i for a in p.attribute if a.name == "axis"), 1) % max(q.ndim, 1)
        shape = [-1 if d == axis else 1 for d in range(q.ndim)]
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    return np.asarray((q.astype(np.float64) - zero) * scale.astype(np.float64))


def _site(node, slots, consts, producer, names, order, seen_scales) -> Site | None:
    scale_name = node.input[slots[0]]
    scale = consts.get(scale_name)
    zp_name = node.input[slots[1]] if len(node.input) > slots[1] else ""
    zp = consts.get(zp_name) if zp_name else None
    elem = onnx.TensorProto.UINT8
    if zp is not None:
        elem = onnx.helper.np_dtype_to_tensor_dtype(zp.dtype)
    step = float(scale.reshape(-1)[0]) if scale is not None and scale.size == 1 else None
    zero = int(zp.reshape(-1)[0]) if zp is not None and zp.size >= 1 else 0
    if node.op_type == "QuantizeLinear":
        source = node.input[0]
        p = producer.get(source)
        op, layer = (p.op_type, p.name) if p is not None else ("input", source)
        if p is not None and p.op_type == "DequantizeLinear":  # a requantization Q(DQ(x))
            op = "Requantize"
    else:
        source, op, layer = "", node.op_type, node.name
    if scale_name not in seen_scales:  # the recorded quantizer owns the first Q of its scale
        layer = _label(names.get(scale_name), layer)
    seen_scales.add(scale_name)
    return Site(node.output[0], order, op, layer, step, zero, elem, source, scale_name)


# torch calls that compute nothing in eval mode (a quantizer is named after the fx node it reads)
_NO_OP_CALL = re.compile(
    r"(to|contiguous|clone|detach|float|type_as|alias|_to_copy|dropout|identity)(_\d+)?"
)


def _label(quantizer: str | None, node: str) -> str:
    """The site's layer: its quantizer's name; where that names a call that computes nothing
    (``encoder/to`` after ``x.transpose(1, 2).to(dtype)``), the ONNX node computing the tensor
    instead: its module-path name (``encoder.transpose``, ``exporter._node_names``), or in files
    exported before those names, the quantizer's module and torch's node name
    (``encoder/transpose`` for ``node_transpose``)."""
    if not quantizer:
        return node
    module, _, call = quantizer.rpartition("/")
    if not _NO_OP_CALL.fullmatch(call) or not node:
        return quantizer
    op = node.removeprefix("node_")
    if op == node:  # a module-path name says where it is by itself
        return node
    return f"{module}/{op}" if module else op


def _dynamic_site(node, producer, order) -> Site:
    """A ``DynamicQuantizeLinear``'s uint8 codes: its scale and zero point are computed from each
    input's range at run time, so the site has no fixed step (``scale`` None)."""
    source = node.input[0]
    p = producer.get(source)
    op = p.op_type if p is not None else "input"
    return Site(node.output[0], order, op, node.name or source, None, 0, onnx.TensorProto.UINT8,
                source)  # fmt: skip


def match_names(sites: list[Site], available: set[str]) -> dict[str, str]:
    """Site name -> the same tensor name, where ``available`` has it."""
    return {s.name: s.name for s in sites if s.name in available}


def match_sources(sites: list[Site], available: set[str]) -> dict[str, str]:
    """Site name -> the float tensor its QuantizeLinear reads, where ``available`` has it."""
    return {s.name: s.source for s in sites if s.source and s.source in available}


def quantizer_sites(model: onnx.ModelProto) -> dict[str, str]:
    """Quantized tensor -> the activation quantizer that wrote it, from quantbridge's export
    record (merged quantizers included: each keeps its own tensors); empty if none."""
    for prop in model.metadata_props:
        if prop.key == QUANTIZERS_KEY:
            record = json.loads(prop.value)
            return {
                t: k
                for k, v in record.items()
                if v.get("kind") == "activation"
                for t in v.get("sites", ())
            }
    return {}


def match_other_file(
    sites: list[Site], other: list[Site], recorded: dict[str, str] | None = None
) -> dict[str, str]:
    """Site name -> the matching site name of a second quantized file: same tensor name, else
    the same float source tensor, else (``recorded``: ``other``'s ``quantizer_sites``) the
    tensor of ``other``'s quantizer named after the site's source tensor (a QuantizeLinear's
    input) or after the site itself (a QOperator op's output), as a QuantModel imported from the
    first file names its quantizers, and its export records; each site of ``other`` is used
    once."""
    recorded = recorded or {}
    by_name = {s.name: s for s in other}
    by_source = {s.source: s for s in other if s.source}
    by_quantizer: dict[str, Site] = {}
    for s in other:  # a quantizer's first tensor: data movement after it reuses its grid
        if s.name in recorded:
            by_quantizer.setdefault(recorded[s.name], s)
    found, used = {}, set()
    for s in sites:
        hit = by_name.get(s.name) or (by_source.get(s.source) if s.source else None)
        if hit is None:
            hit = by_quantizer.get(s.source or s.name)
        if hit is not None and hit.name not in used:
            found[s.name] = hit.name
            used.add(hit.name)
    return found
