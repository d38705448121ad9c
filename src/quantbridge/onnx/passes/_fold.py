"""``FoldQOperator``, the QDQ -> QOperator pass, and ``fold(src, dst)``, its public entry point.

The pass runs in three steps: check the input (a quantized model whose Q/DQ pairs agree),
normalise (cases 1-3, ``_normalize``), then offer every node to the handler registered for its
op type (cases 4-14), and finally drop the QuantizeLinear / DequantizeLinear nodes and
initializers nothing reads any more. Nodes without a handler, or whose handler declines, stay
as they are (in QDQ form); ``quantbridge inspect`` lists them.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import onnx

from ...optables import FUSED_DYNAMIC_OPS, GROUP_WISE_OPS
from .._control_flow import refusal
from .._load import parse_onnx
from .._qonnx import qonnx_to_qcdq
from ..importer._const_quantize import fold_constant_quantize
from ..importer._fp16 import widen_float16
from . import _fold_elementwise, _fold_linear, _fold_pool  # noqa: F401  (they register folds)
from ._graph import MS_DOMAIN, GraphView, label
from ._normalize import normalize
from ._registry import fold_handler
from ._saturation import SaturationWarning, saturating_layers, saturation_message

_QDQ = ("QuantizeLinear", "DequantizeLinear")


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (new) model and whether the pass changed anything."""

    model: onnx.ModelProto
    modified: bool


class FoldQOperator:
    """QDQ ONNX -> ONNX integer operators (QLinearConv, QGemm, QLinearAdd, ...); see the
    package docstring for the numbered rewrite cases. Stateless: ``FoldQOperator()(model)``."""

    def __call__(self, model: onnx.ModelProto) -> PassResult:
        g = GraphView.of(model)
        check_foldable(g)
        g, modified = normalize(g)
        for n in list(g.nodes):
            handler = fold_handler(n.op_type)
            if handler is None or not any(m is n for m in g.nodes):  # removed by an earlier fold
                continue
            rewrite = handler(g, n)
            if rewrite is not None:
                g, modified = g.apply(rewrite), True
        return PassResult(_to_model(model, g) if modified else model, modified)


def check_foldable(g: GraphView) -> None:
    """ValueError for a float model, and for a QuantizeLinear whose DequantizeLinear partner
    uses other parameters (the pair would not be a quantization but a silent rescale)."""
    has_qdq = bool({n.op_type for n in g.nodes} & set(_QDQ))
    dynamic = [label(n) for n in g.nodes if n.op_type == "DynamicQuantizeLinear"]
    if dynamic:
        raise ValueError(
            f"the model is dynamically quantized (ONNX Runtime's quantize_dynamic: "
            f"{', '.join(dynamic[:3])}{', ...' if len(dynamic) > 3 else ''} "
            "feeding ConvInteger / MatMulInteger): its activation scales are computed from each "
            "input at run time, and QLinearConv / QLinearMatMul need fixed ones. Quantize the "
            "float model statically (`quantbridge quantize FLOAT.onnx --calib CALIB.npz`, or "
            "onnxruntime's quantize_static in QDQ format), then fold that file"
        )
    group_wise = [n for n in g.nodes if n.op_type in GROUP_WISE_OPS]
    nbits = [label(n) for n in group_wise]
    if nbits and not has_qdq:
        raise ValueError(
            f"{nbits[0]} holds group-wise weights (ONNX Runtime's weight-only "
            f"{group_wise[0].op_type}"
            f"{f', {len(nbits)} such nodes' if len(nbits) > 1 else ''}) and the model has no "
            "QuantizeLinear/DequantizeLinear: there is nothing to fold (the integer operators "
            "take per-tensor or per-channel weight scales). Run the file as it is in ONNX "
            "Runtime, or quantize the float model statically with per-channel weights "
            "(`quantbridge quantize FLOAT.onnx --calib CALIB.npz`) and fold that file"
        )
    fused = [label(n) for n in g.nodes if n.op_type in FUSED_DYNAMIC_OPS]
    if fused and not has_qdq:
        raise ValueError(
            f"the model is dynamically quantized ({', '.join(fused[:3])}"
            f"{', ...' if len(fused) > 3 else ''}: ONNX Runtime's quantize_dynamic, fused by its "
            "graph optimisations): each op quantizes its input with a scale computed at run time, "
            "and QLinearMatMul / QGemm need fixed ones; there is nothing to fold. Quantize the "
            "float model statically (`quantbridge quantize FLOAT.onnx --calib CALIB.npz`, or "
            "onnxruntime's quantize_static in QDQ format), then fold that file"
        )
    if not has_qdq:
        raise ValueError(
            refusal(g.graph, "fold")
            or (
                "the model has no QuantizeLinear/DequantizeLinear nodes: it is a float model. "
                "Quantize it first (qb.quantize + qb.export, or onnxruntime's quantize_static in QDQ "
                "format), then fold the QDQ file"
            )
        )
    for q in g.nodes:
        if q.op_type != "QuantizeLinear":
            continue
        q_params = g.qparams(q)
        for dq in g.consumers.get(q.output[0], []):
            if dq.op_type != "DequantizeLinear" or q_params is None:
                continue
            dq_params = g.qparams(dq)
            if dq_params is not None and not dq_params.same_as(q_params):
                raise ValueError(
                    f"{label(q)} ({q_params.describe()}) feeds {label(dq)} with other "
                    f"parameters ({dq_params.describe()}); a Q/DQ pair must share scale and "
                    "zero point. Re-export the model, or fix the DequantizeLinear's scale"
                )


def _live(g: GraphView) -> list[onnx.NodeProto]:
    """Nodes minus the Q/DQ/Constant nodes whose outputs nothing reads any more."""
    nodes = list(g.nodes)
    while True:
        read = {t for n in nodes for t in n.input} | g.outputs
        dead = [
            n
            for n in nodes
            if n.op_type in (*_QDQ, "Constant") and not any(t in read for t in n.output)
        ]
        if not dead:
            return nodes
        gone = {id(n) for n in dead}
        nodes = [n for n in nodes if id(n) not in gone]


def _topological(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    ordered, pending, ready = [], list(nodes), set(available)
    while pending:
        rest = []
        for n in pending:
            if all(not t or t in ready for t in n.input):
                ordered.append(n)
                ready.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise AssertionError(f"fold produced a cycle or a dangling input at {label(rest[0])}")
        pending = rest
    return ordered


def _keep_node_names(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """An integer op takes the name of the node it replaced (``layer1.0.conv1``, not
    ``layer1.0.conv1_qb``: ``GraphView.fresh`` had to avoid it while both were in the graph),
    wherever that name is free in the folded graph. Node names only: no value is renamed."""
    taken = {n.name for n in nodes}
    for n in nodes:
        base = n.name.removesuffix("_qb")
        if base != n.name and base and base not in taken:
            taken.add(base)
            n.name = base
    return nodes


def _to_model(model: onnx.ModelProto, g: GraphView) -> onnx.ModelProto:
    nodes = _live(g)
    read = {t for n in nodes for t in n.input} | g.outputs
    inits = [t for name, t in g.initializers.items() if name in read]
    available = {i.name for i in model.graph.input} | {t.name for t in inits}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    del graph.node[:], graph.initializer[:], graph.value_info[:]
    graph.node.extend(_keep_node_names(_topological(nodes, available)))
    graph.initializer.extend(inits)
    # an initializer listed as a graph input (IR < 4 style; Brevitas's dynamo export lifts every
    # constant so) whose initializer the fold dropped is no input of the folded model
    dropped = {i.name for i in model.graph.initializer} - {t.name for t in inits}
    kept = [i for i in graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend(kept)
    if any(n.domain == MS_DOMAIN for n in nodes) and all(
        o.domain != MS_DOMAIN for o in out.opset_import
    ):
        out.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    return out


def fold(
    src: str | os.PathLike | onnx.ModelProto, dst: str | os.PathLike | None = None
) -> onnx.ModelProto:
    """Fold a QDQ ONNX model into ONNX integer operators; write it to ``dst`` (if given).

    ``src`` is a path or a ``ModelProto``. Returns the folded model. Ops without an integer form
    stay in QDQ form (``quantbridge inspect`` names them). A float16 graph (ModelOpt's default
    mode) is folded as float32, its Casts between float types as Identity
    (``Float16GraphWarning``): the integer operators take float32 scales. Raises ``ValueError`` for a float
    model and for a Q/DQ pair whose parameters differ, ``FileNotFoundError`` for a missing file.
    On x86 without VNNI a ``SaturationWarning`` names the folded layers whose int8 weight codes
    this machine's ONNX Runtime sums with saturation (``_saturation``).
    """
    if isinstance(src, onnx.ModelProto):
        model = src
    elif isinstance(src, (str, os.PathLike)):
        if not os.path.isfile(src):
            raise FileNotFoundError(f"{os.fspath(src)}: no such file")
        model = parse_onnx(lambda: onnx.load(os.fspath(src)), repr(os.fspath(src)))
    else:
        raise TypeError(f"fold expects a path or an onnx.ModelProto, got {type(src).__name__}")
    # QLinearConv & co. take float32 scales: a float16 graph (ModelOpt) folds as float32 (warns)
    # a weight quantized at run time (ModelOpt: float W -> QuantizeLinear) folds as its codes
    model = fold_constant_quantize(widen_float16(qonnx_to_qcdq(model), float_casts="identity"))
    result = FoldQOperator()(model)
    folded = result.model
    integer_ops = sorted({n.op_type for n in model.graph.node if n.op_type.startswith("QLinear")})
    if not result.modified and integer_ops:
        name = "the model" if isinstance(src, onnx.ModelProto) else repr(os.fspath(src))
        warnings.warn(
            f"{name} is already folded ({', '.join(integer_ops[:4])}): nothing left to fold"
            f"{', written unchanged' if dst is not None else ''}; fold takes the QDQ file that "
            "qb.export or `quantbridge quantize` writes",
            stacklevel=2,
        )
    saturating = saturating_layers(folded) if result.modified else []
    if saturating:
        warnings.warn(saturation_message(saturating), SaturationWarning, stacklevel=2)
    if dst is not None:
        onnx.save(folded, os.fspath(dst))
    return folded
