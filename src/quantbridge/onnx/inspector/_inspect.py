"""``inspect_model``: what an ONNX file computes in int8, what stays float, how weights are stored.

The report answers the questions people ask of an exported INT8 model before they ship it:

* opsets, IR version, producer, inputs and outputs (shape, dtype), op counts;
* which compute ops run in int8 and which in float (rules below);
* Q/DQ nodes left (and how many QuantizeLinear -> DequantizeLinear pairs), activation bit widths;
* weight storage: every initializer feeding a Conv/Gemm/MatMul weight input, directly or through
  DequantizeLinear, with its dtype, the bits its integers use, per-channel or per-tensor; float
  weights are listed on their own ("float weights: none" is what a good export shows);
* the model's size on disk (external data files included);
* Concats whose inputs keep their own scales, and whether their output is float (``_concat``).

When is a node "int8"? In order (the first that applies wins):

1. QuantizeLinear / DequantizeLinear / DynamicQuantizeLinear are not compute ops; they are counted
   apart, and so is an integer Clip between QuantizeLinear and DequantizeLinear (part of the
   grid). Constant and shape plumbing are neither.
2. QOperator ops (QLinearConv, QGemm, ConvInteger, QLinearAdd, ...; ``QOPERATOR_OPS``) are int8.
3. Data-movement ops (``DATA_MOVEMENT_OPS``: MaxPool, Reshape, Transpose, ...) whose data inputs are
   quantized integers (QOperator form) are int8.
4. QDQ form: an op is int8 when every float input comes from a DequantizeLinear and every consumer
   of its outputs is a QuantizeLinear - possibly through a Relu/Clip that the QuantizeLinear
   absorbs. A Relu is absorbed when the QuantizeLinear's zero point is the type's qmin (its clamp
   at qmin *is* the Relu); a Clip when the QuantizeLinear's range lies inside the Clip's. These are
   ONNX Runtime's ReluQuantFusion / ClipQuantFusion conditions; the absorbed Relu/Clip itself
   counts as int8. An input still "comes from a DequantizeLinear" through layout ops that ONNX
   Runtime moves it across (``DEQUANTIZE_TRANSPARENT_OPS``): ``nn.Linear`` on 3-D input exports as
   ``DQ(int8 W) -> Transpose -> MatMul``; the weight's Transpose is constant work (folded), not
   counted at all.
5. A MatMul whose inputs are all dequantized but whose output is float (``INT8_FLOAT_OUTPUT_OPS``)
   is int8: ONNX Runtime runs it as MatMulIntegerToFloat (int8 product, float result).
6. Everything else is float.

QONNX ``Quant`` (Brevitas, FINN) is read as the Q -> Clip -> DQ it computes (``onnx/_qonnx``, as
import / fold / lower / compare do): ``op_counts`` lists the file's ops, the rest that QCDQ form;
a QONNX node the rewrite refuses (``BipolarQuant``, ...) is neither int8 nor float (rule 1).

Bit widths: from the Clip between QuantizeLinear and DequantizeLinear when there is one (narrow
range, sub-8-bit), else from the integer type; for weights, the bits their stored integers need.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from ...optables import (
    DATA_MOVEMENT_OPS,
    INT8_FLOAT_OUTPUT_OPS,
    QDQ_OPS,
    QOPERATOR_OPS,
    WEIGHTED_OPS,
    WeightSlots,
)
from .._control_flow import quantized_bodies
from .._qonnx import QONNX_DOMAINS, qonnx_to_qcdq
from ..importer._const_quantize import fold_constant_quantize
from ..importer._fp16 import is_float16
from ._blocked import block_granularity, matmul_nbits_weight
from ._concat import separate_scale_concats
from ._graph import FLOAT_TYPES, QUANT_TYPES, Graph, bits_for_range, type_name, type_range
from ._report import InspectReport, TensorInfo, WeightInfo

_NOT_COMPUTE = frozenset({"Constant", "Shape", "Size", "ConstantOfShape"})
_ABSORBED_BY_QUANTIZE = frozenset({"Relu", "Clip"})


# -- loading ------------------------------------------------------------------------------------
def _load(
    path_or_proto: str | os.PathLike | onnx.ModelProto,
) -> tuple[onnx.ModelProto, str | None, int]:
    if isinstance(path_or_proto, onnx.ModelProto):
        return path_or_proto, None, path_or_proto.ByteSize()
    if not isinstance(path_or_proto, (str, os.PathLike)):
        raise TypeError(
            f"inspect_model expects a path or an onnx.ModelProto, got {type(path_or_proto).__name__}"
        )
    path = os.fspath(path_or_proto)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: is a directory, not an ONNX file")
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends
        raise ValueError(f"{path}: not an ONNX model ({_first_line(e)})") from None
    if model.ir_version == 0 or not model.HasField("graph"):
        raise ValueError(f"{path}: not an ONNX model (no IR version or graph)")
    size = _size_on_disk(model, path)
    try:
        onnx.external_data_helper.load_external_data_for_model(
            model, os.path.dirname(os.path.abspath(path))
        )
    except Exception as e:
        raise ValueError(f"{path}: cannot read its external data ({_first_line(e)})") from None
    return model, path, size


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _size_on_disk(model: onnx.ModelProto, path: str) -> int:
    """The file plus the external data files its initializers name (read before loading them)."""
    folder = os.path.dirname(os.path.abspath(path))
    files = {
        e.value
        for init in model.graph.initializer
        if init.data_location == TensorProto.EXTERNAL
        for e in init.external_data
        if e.key == "location"
    }
    extra = [os.path.join(folder, f) for f in files]
    return os.path.getsize(path) + sum(os.path.getsize(f) for f in extra if os.path.isfile(f))


def _node_label(node: onnx.NodeProto, index: int) -> str:
    return f"{node.op_type} {node.name!r}" if node.name else f"{node.op_type} #{index}"


# -- int8 or float ------------------------------------------------------------------------------
def _absorbed(g: Graph, act: onnx.NodeProto, quantize: onnx.NodeProto) -> bool:
    """Does ``quantize`` make the Relu/Clip ``act`` in front of it redundant? (module docstring)"""
    scale = g.array(quantize.input[1])
    zero_point = g.array(quantize.input[2]) if len(quantize.input) > 2 else np.zeros(1, np.uint8)
    if scale is None or zero_point is None:
        return False
    qmin, qmax = type_range(g.quantize_type(quantize))
    if act.op_type == "Relu":
        return bool(np.all(zero_point == qmin))
    lo, hi = _clip_bounds(g, act)
    lo_q = (qmin - zero_point.astype(np.float64)) * scale
    hi_q = (qmax - zero_point.astype(np.float64)) * scale
    half = 0.5 * scale
    ok_lo = lo is None or bool(np.all(lo_q >= lo - half))
    ok_hi = hi is None or bool(np.all(hi_q <= hi + half))
    return ok_lo and ok_hi


def _feeds_quantize(g: Graph, tensor: str, through_activation: bool = True) -> bool:
    """Every consumer of ``tensor`` is a QuantizeLinear (or an activation one absorbs)."""
    users = g.consumers.get(tensor, [])
    if not users or tensor in g.outputs:
        return False
    for user in users:
        if user.op_type == "QuantizeLinear" and user.input[0] == tensor:
            continue
        if (
            through_activation
            and user.op_type in _ABSORBED_BY_QUANTIZE
            and _absorbed_after(g, user)
        ):
            continue
        return False
    return True


def _absorbed_after(g: Graph, act: onnx.NodeProto) -> bool:
    users = g.consumers.get(act.output[0], [])
    return _feeds_quantize(g, act.output[0], through_activation=False) and all(
        _absorbed(g, act, q) for q in users
    )


def _qdq_int8(g: Graph, node: onnx.NodeProto) -> str | None:
    """Rules 4 and 5: ``"qdq"`` (dequantized inputs, quantized outputs), ``"int8-float-output"``
    (a MatMul on dequantized inputs with a float output: MatMulIntegerToFloat), or None."""
    data = [t for t in node.input if t and g.is_float_data(t)]
    if not data or not all(g.dequantized(t) for t in data):
        return None
    outs = [t for t in node.output if t and (t in g.consumers or t in g.outputs)]
    if outs and all(_feeds_quantize(g, t) for t in outs):
        return "qdq"
    return "int8-float-output" if node.op_type in INT8_FLOAT_OUTPUT_OPS else None


def _classify(g: Graph, node: onnx.NodeProto, int8_tensors: set[str]) -> str | None:
    """The rule that decides ``node`` (module docstring), or None for nodes that are not compute.

    "qoperator", "integer-data", "qdq", "int8-float-output", "absorbed" mean int8; "float" means
    float.
    """
    op = node.op_type
    if op in QDQ_OPS or op in _NOT_COMPUTE or node.domain in QONNX_DOMAINS:
        return None
    if g.constant_layout(node):
        return None
    if op == "Clip" and g.produced_by(node.input[0], "QuantizeLinear"):
        return None  # the integer clamp of a Q -> Clip -> DQ grid (narrow range, uint8 post-ReLU)
    if op in QOPERATOR_OPS:
        return "qoperator"
    data = [t for t in node.input if t] if op == "Concat" else node.input[:1]
    if op in DATA_MOVEMENT_OPS and data and all(g.is_quantized(t) for t in data):
        return "integer-data"
    qdq = _qdq_int8(g, node)
    if qdq is not None:
        return qdq
    if op in _ABSORBED_BY_QUANTIZE and node.input[0] in int8_tensors and _absorbed_after(g, node):
        return "absorbed"
    return "float"


def _compute_ops(g: Graph) -> tuple[Counter, Counter, list[str], Counter]:
    """int8 op counts, float op counts, float node labels, and how often each rule decided."""
    int8, floats, float_nodes, rules = Counter(), Counter(), [], Counter()
    int8_tensors: set[str] = set()
    for i, node in enumerate(g.nodes):
        rule = _classify(g, node, int8_tensors)
        if rule is None:
            continue
        rules[rule] += 1
        if rule == "float":
            floats[node.op_type] += 1
            float_nodes.append(_node_label(node, i))
        else:
            int8[node.op_type] += 1
            int8_tensors.update(node.output)
    return int8, floats, float_nodes, rules


# -- Q/DQ and activations -----------------------------------------------------------------------
def _quantize_nodes(g: Graph) -> tuple[int, Counter]:
    """Number of QuantizeLinear -> [Clip ->] DequantizeLinear pairs, and their integer ranges."""
    pairs, schemes = 0, Counter()
    for node in g.nodes:
        if node.op_type != "QuantizeLinear":
            continue
        dtype = g.quantize_type(node)
        full = type_range(dtype) if dtype in QUANT_TYPES else (None, None)
        for user in g.consumers.get(node.output[0], []):
            lo, hi = full
            ends = [user]
            if user.op_type == "Clip":
                lo, hi = _clip_range(g, user, lo, hi)
                ends = g.consumers.get(user.output[0], [])
            for end in ends:
                if end.op_type == "DequantizeLinear":
                    pairs += 1
                    if lo is not None:
                        bits = bits_for_range(lo, hi)
                        schemes[f"{type_name(dtype)} [{lo}, {hi}] {bits}-bit"] += 1
    return pairs, schemes


def _clip_bounds(g: Graph, clip: onnx.NodeProto) -> tuple[Any, Any]:
    """A Clip's (min, max), None where unbounded: inputs 1 and 2 (opset 11+) or attributes."""
    attrs = {a.name: a.f for a in clip.attribute}
    bounds = []
    for index, name in ((1, "min"), (2, "max")):
        if len(clip.input) > index and clip.input[index]:
            value = g.array(clip.input[index])
            bounds.append(None if value is None else value.item())
        else:
            bounds.append(attrs.get(name))
    return bounds[0], bounds[1]


def _clip_range(g: Graph, clip: onnx.NodeProto, lo, hi) -> tuple[Any, Any]:
    """``[lo, hi]`` narrowed by an integer Clip's bounds."""
    lo_c, hi_c = _clip_bounds(g, clip)
    lo = lo if lo_c is None else int(lo_c) if lo is None else max(lo, int(lo_c))
    hi = hi if hi_c is None else int(hi_c) if hi is None else min(hi, int(hi_c))
    return lo, hi


# -- weights ------------------------------------------------------------------------------------
def _trace_weight(g: Graph, tensor: str) -> tuple[str, onnx.NodeProto | None, tuple | None] | None:
    """Follow a weight input back to its initializer: (name, DequantizeLinear or None, clip range)."""
    dq, clip = None, None
    for _ in range(8):
        if tensor in g.constants:
            return tensor, dq, clip
        node = g.producer.get(tensor)
        if node is None:
            return None
        if node.op_type == "DequantizeLinear" and dq is None:
            dq = node
        elif node.op_type == "Clip":
            clip = _clip_range(g, node, None, None)
        elif node.op_type not in ("Transpose", "Reshape", "Identity", "Cast"):
            return None
        tensor = node.input[0]
    return None


def _granularity(g: Graph, scale_name: str | None, axis: int | None) -> str:
    scale = g.array(scale_name) if scale_name else None
    if scale is None:
        return "per-tensor" if scale_name else "unknown"
    if scale.size <= 1:
        return "per-tensor"
    if axis is None:
        return f"per-channel({scale.size} scales)"
    return f"per-channel(axis={axis})"


def _weight_info(
    g: Graph, node: onnx.NodeProto, index: int, slots: WeightSlots
) -> WeightInfo | None:
    if len(node.input) <= slots.weight or not node.input[slots.weight]:
        return None
    traced = _trace_weight(g, node.input[slots.weight])
    if traced is None:
        return None  # an activation (q @ k^T), not a weight
    name, dq, clip = traced
    values = g.array(name)
    dtype = g.constants[name].data_type
    is_float = dtype in FLOAT_TYPES
    value_range = (float(values.min()), float(values.max())) if values.size else None
    if is_float:
        bits, granularity = 8 * values.dtype.itemsize, "float"
    else:
        lo, hi = clip if clip is not None else (None, None)
        lo = int(values.min()) if lo is None else lo
        hi = int(values.max()) if hi is None else hi
        bits = bits_for_range(lo, hi) if values.size else type_range(dtype)[1].bit_length()
        if dq is not None:
            axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
            granularity = block_granularity(dq, axis) or _granularity(g, dq.input[1], axis)
        else:
            scale = node.input[slots.scale] if slots.scale is not None else None
            granularity = _granularity(g, scale, 0 if "Conv" in node.op_type else None)
    bias_dtype = None
    if slots.bias is not None and len(node.input) > slots.bias and node.input[slots.bias]:
        bias = _trace_weight(g, node.input[slots.bias])
        if bias is not None:
            bias_dtype = type_name(g.constants[bias[0]].data_type)
    return WeightInfo(
        node=node.name or f"#{index}",
        op_type=node.op_type,
        name=name,
        dtype=type_name(dtype),
        shape=tuple(int(d) for d in g.constants[name].dims),
        is_float=is_float,
        bits=bits,
        granularity=granularity,
        value_range=value_range,
        bias_dtype=bias_dtype,
    )


def _weights(g: Graph) -> list[WeightInfo]:
    found = []
    for i, node in enumerate(g.nodes):
        slots = WEIGHTED_OPS.get(node.op_type) or QOPERATOR_OPS.get(node.op_type)
        if node.op_type == "MatMulNBits":  # packed group-wise weights (``_blocked``)
            info = matmul_nbits_weight(g, node, i)
            found += [info] if info is not None else []
        elif slots is not None:
            info = _weight_info(g, node, i, slots)
            if info is not None:
                found.append(info)
    return found


# -- the report ---------------------------------------------------------------------------------
def _tensor_infos(values) -> list[TensorInfo]:
    infos = []
    for v in values:
        tt = v.type.tensor_type
        shape = None
        if tt.HasField("shape"):
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in tt.shape.dim
            )
        infos.append(TensorInfo(v.name, type_name(tt.elem_type or None), shape))
    return infos


def _qdq_ops(g: Graph) -> list[str]:
    """Compute ops left in QDQ form: they read a DequantizeLinear or write into a QuantizeLinear
    (after ``quantbridge fold``: the ops that did not fold)."""
    found = []
    for i, node in enumerate(g.nodes):
        if node.op_type in QDQ_OPS or node.op_type in _NOT_COMPUTE:
            continue
        reads_dq = any(g.produced_by(t, "DequantizeLinear") for t in node.input if t)
        feeds_q = any(
            user.op_type == "QuantizeLinear" for t in node.output for user in g.consumers.get(t, [])
        )
        if reads_dq or feeds_q:
            found.append(_node_label(node, i))
    return found


def _form(rules: Counter, op_counts: Counter, qdq_ops: list[str], bodies: list[str]) -> str:
    if rules["qoperator"]:
        return "QDQ+QOperator" if rules["qdq"] or qdq_ops else "QOperator"
    if rules["qdq"] or rules["int8-float-output"]:
        return "QDQ"
    if op_counts["QuantizeLinear"] or op_counts["DequantizeLinear"]:
        return "QDQ"
    if op_counts["MatMulNBits"]:
        return "weight-only (MatMulNBits)"
    return f"float (quantized inside {', '.join(bodies[:3])}: not read)" if bodies else "float"


def inspect_model(path_or_proto: str | os.PathLike | onnx.ModelProto) -> InspectReport:
    """Inspect an ONNX model (a path or a ``ModelProto``); see the module docstring.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for a file that is not an
    ONNX model. Only the main graph is inspected (not If/Loop subgraphs).
    """
    model, path, size = _load(path_or_proto)
    try:
        qcdq = qonnx_to_qcdq(model)  # QONNX's Quant as the Q -> Clip -> DQ it computes
    except ValueError:
        qcdq = model  # a form the rewrite refuses: its nodes count as quantization (rule 1)
    g = Graph(fold_constant_quantize(qcdq))  # a weight quantized at run time counts as int8
    op_counts = Counter(n.op_type for n in g.nodes)
    int8, floats, float_nodes, rules = _compute_ops(g)
    pairs, schemes = _quantize_nodes(g)
    qdq_ops = _qdq_ops(g)
    initializers = {i.name for i in model.graph.initializer}
    return InspectReport(
        path=path,
        size_bytes=size,
        ir_version=model.ir_version,
        opsets={o.domain: o.version for o in model.opset_import},
        producer=" ".join(p for p in (model.producer_name, model.producer_version) if p),
        form=_form(rules, op_counts, qdq_ops, quantized_bodies(model)),
        inputs=_tensor_infos([i for i in model.graph.input if i.name not in initializers]),
        outputs=_tensor_infos(model.graph.output),
        op_counts=dict(
            op_counts if qcdq is model else Counter(n.op_type for n in model.graph.node)
        ),
        int8_ops=dict(int8),
        float_ops=dict(floats),
        float_nodes=float_nodes,
        quantize_nodes=op_counts.get("QuantizeLinear", 0),
        dequantize_nodes=op_counts.get("DequantizeLinear", 0),
        qdq_pairs=pairs,
        activation_quantizers=dict(schemes),
        weights=_weights(g),
        qdq_ops=qdq_ops,
        concats=separate_scale_concats(g),
        float16=is_float16(model),
    )


__all__ = ["InspectReport", "TensorInfo", "WeightInfo", "bits_for_range", "inspect_model"]
