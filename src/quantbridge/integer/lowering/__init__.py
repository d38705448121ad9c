"""Lowering of a QDQ (or QOperator) ONNX model to an ``IntegerProgram``.

ONNX Runtime's contrib QOperator ops (QLinearAdd, QGemm, QLinearConcat, QLinearSigmoid, ...: what
``quantize_static(quant_format=QOperator)`` and ``fold`` write) are first unfolded into the
canonical QDQ form, ``DequantizeLinear -> float op -> QuantizeLinear``, which is their definition
(``onnx.passes.UnfoldQOperator``): one lowering of each QDQ pattern then serves both forms, and
no second integer kernel per op can drift from the first. QLinearConv / QLinearMatMul /
ConvInteger / MatMulInteger are lowered directly (``_qlinear``).

``lower`` walks the graph once in topological order, interpreting each node symbolically
(``_core`` explains the values) through a registry keyed by ONNX op type; one module per op
family registers its handlers. Refusals are collected so that one error lists them all: the
ops that have no lowering, and the layers whose accumulator could overflow.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from ...onnx._control_flow import refusal
from ...onnx._load import parse_onnx
from ...onnx._qonnx import qonnx_to_qcdq
from ...onnx._weight_only import weight_only_readers
from ...onnx.importer._const_quantize import fold_constant_quantize
from ...onnx.importer._fp16 import widen_float16
from ...onnx.passes import unfold, unfoldable_ops
from ...onnx.passes._graph import MS_DOMAIN
from ...optables import FUSED_DYNAMIC_OPS, GROUP_WISE_OPS
from .._program import IntegerProgram
from . import (  # noqa: F401  (registry)
    _concat,
    _divide,
    _einsum,
    _eltwise,
    _index,
    _linear,
    _movement,
    _nonfinite,
    _normalize,
    _pool,
    _qdq,
    _qlinear,
    _resize,
)
from ._core import (
    LOWERINGS,
    Builder,
    Const,
    FloatInput,
    IndexValue,
    IntInput,
    LoweringError,
    QValue,
    Value,
    node_name,
)
from ._decomposed_norm import fuse_decomposed_layer_norms
from ._outputs import graph_outputs, with_input_shapes
from ._shape_fold import fold_shape_arithmetic

QUANTIZATION_OPS = {"QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul",
                    "ConvInteger", "MatMulInteger"}  # fmt: skip


def _load(src: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """The model; a quantized float16 graph (ModelOpt's default mode) read as float32, its Casts
    between float types as Identity (``Float16GraphWarning``): the program's integer codes and
    fixed-point scales are the file's, its float parts float32 instead of float16."""
    if isinstance(src, onnx.ModelProto):
        model = src
    elif not os.path.isfile(src):
        raise FileNotFoundError(f"no ONNX file at {os.fspath(src)!r}")
    else:
        model = parse_onnx(lambda: onnx.load(os.fspath(src)), repr(os.fspath(src)))
    try:
        model = qonnx_to_qcdq(model)  # QONNX's Quant op (Brevitas, FINN) as Q -> Clip -> DQ
    except ValueError as e:
        raise LoweringError(str(e)) from e
    try:
        model = unfold(model)
    except ValueError as e:
        raise LoweringError(f"cannot lower the QOperator model: {e}") from e
    if any(n.op_type in QUANTIZATION_OPS for n in model.graph.node):
        model = fold_constant_quantize(widen_float16(model, float_casts="identity"))
    return model


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    # ONNX's shape inference does not know com.microsoft Q/DQ (ORT's int4 / int16 files below
    # opset 21): every shape after them was lost. Inferred as the standard ops (same shapes)
    contrib = [n for n in model.graph.node if n.domain == "com.microsoft"
               and n.op_type in ("QuantizeLinear", "DequantizeLinear")]  # fmt: skip
    if contrib:
        model = _standard_qdq_copy(model)
    shapes = _inferred_shapes(model)
    unknown = sum(None in s for s in shapes.values())
    while unknown:  # shape arithmetic inference did not follow; each round may free the next
        folded = fold_shape_arithmetic(model, shapes)  # block's (its Shape ops read them)
        if folded is None:
            break
        del folded.graph.value_info[:]  # the file's symbolic entries would stand
        for name, shape in _inferred_shapes(folded).items():
            old = shapes.get(name)
            if old is None or sum(d is None for d in shape) < sum(d is None for d in old):
                shapes[name] = shape
        unknown, before = sum(None in s for s in shapes.values()), unknown
        if unknown >= before:
            break
    return shapes


def _inferred_shapes(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    try:  # data_prop: a Reshape to a shape computed by Shape ops (torch's GroupNorm) is known
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 - shapes only sharpen bounds; lowering reports what it lacks
        try:
            inferred = onnx.shape_inference.infer_shapes(model)
        except Exception:  # noqa: BLE001
            inferred = model
    g = inferred.graph
    shapes = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None
                                    for d in t.shape.dim)  # fmt: skip
    for init in g.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def _standard_qdq_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for n in copy.graph.node:
        if n.domain == "com.microsoft" and n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            n.domain = ""
    return copy


def _recorded_scope(model: onnx.ModelProto) -> str:
    """The ``activation_scope`` of the recipe quantbridge's export recorded ("all" if none)."""
    for prop in model.metadata_props:
        if prop.key == "quantbridge.recipe":
            try:
                return str(json.loads(prop.value).get("activation_scope", "all"))
            except (ValueError, AttributeError):
                return "all"  # not ours to judge: lowering reports what it cannot lower
    return "all"


_DQL = frozenset({"DynamicQuantizeLinear"})
_DYNAMIC = FUSED_DYNAMIC_OPS | _DQL


def _check(model: onnx.ModelProto) -> None:
    nodes = model.graph.node
    scope = _recorded_scope(model)
    if scope != "all":
        raise LoweringError(
            f"the model was quantized with activation_scope={scope!r}: its element-wise ops "
            "(adds, norms, softmax ...) run in float, so it has no integer-only program; "
            "quantize with activation_scope='all' (the default) to lower it"
        )
    # a fused op (DynamicQuantizeMatMul ...) is dynamic for sure only with no Q/DQ in the file
    dynamic_ops = _DYNAMIC if not any(n.op_type in QUANTIZATION_OPS for n in nodes) else _DQL
    dynamic = [f"{n.op_type} {node_name(n)!r}" for n in nodes if n.op_type in dynamic_ops]
    if dynamic:
        raise LoweringError(
            f"cannot lower dynamic quantization: {', '.join(dynamic[:3])}"
            f"{f' (and {len(dynamic) - 3} more)' if len(dynamic) > 3 else ''}: the activation "
            "scales and zero points are computed from each input at run time (ONNX Runtime's "
            "quantize_dynamic), so the rescales of an integer-only program would change with "
            "every input: none exists. Quantize the float model statically instead (`quantbridge "
            "quantize FLOAT.onnx --calib CALIB.npz -o Q.onnx`, qb.quantize with calibration data, "
            "or onnxruntime's quantize_static) and lower that file"
        )
    _refuse_blocked(nodes)
    _refuse_weight_only(model)
    if not any(n.op_type in QUANTIZATION_OPS for n in nodes):
        raise LoweringError(
            refusal(model, "lower")
            or "the model has no QuantizeLinear/DequantizeLinear or integer operators: it is a "
            "float model; quantize it first (qb.quantize + qb.export, or `quantbridge quantize`)"
        )
    missing: dict[str, list[str]] = {}
    for n in nodes:
        if n.op_type not in LOWERINGS and n.op_type != "Constant":  # a Constant is a Const
            missing.setdefault(n.op_type, []).append(node_name(n))
    if missing:
        listed = "; ".join(
            f"{op} ({len(v)}: {', '.join(map(repr, v[:5]))}{', ...' if len(v) > 5 else ''})"
            for op, v in sorted(missing.items())
        )
        raise LoweringError(
            f"cannot lower {sum(map(len, missing.values()))} nodes with no integer lowering: "
            f"{listed}. Lowered op types: {', '.join(sorted(LOWERINGS))}"
            f"{_contrib_fix(nodes, missing)}{_op_fixes(missing)}"
        )  # fmt: skip


# what a user can do about an op with no integer kernel (the ones real models hit most)
OP_FIXES = {
    "LSTM": "a recurrent layer (its gates and cell state need a requantization per time step) "
    "has no integer kernel: lower the graph before it and the graph after it as two models, "
    "running the LSTM in float between them, or replace it with convolutions / attention",
    "ScatterND": "an indexed write (x[..., idx] = v exported as ScatterND) has no integer kernel: "
    "write it as torch.cat of slices (which lowers), or apply it outside the program",
    "Col2Im": "nn.Fold has no integer kernel: write it as a ConvTranspose with a one-hot weight "
    "(which lowers), or apply it outside the program",
    "DFT": "a Fourier transform (complex twiddle factors) has no integer kernel: compute the "
    "spectrum in float outside the program and quantize what the model reads of it",
}
OP_FIXES["GRU"] = OP_FIXES["RNN"] = OP_FIXES["LSTM"]
OP_FIXES["STFT"] = OP_FIXES["DFT"]


def _op_fixes(missing: dict[str, list[str]]) -> str:
    fixes = [f"{op}: {OP_FIXES[op]}" for op in sorted(missing) if op in OP_FIXES]
    return f". What to do: {'; '.join(fixes)}" if fixes else ""


_CONTRIB_BLOCK = 128  # the block_size attribute's default in ONNX Runtime's contrib-op specs


def _refuse_blocked(nodes) -> None:
    """Group-wise weights (a blocked DequantizeLinear, ONNX Runtime's MatMulNBits or
    GatherBlockQuantized) have no integer-only lowering: LoweringError naming them and the fix."""
    blocked = [
        (n, next((a.i for a in n.attribute if a.name == "block_size"), 0)
         or (_CONTRIB_BLOCK if n.op_type in GROUP_WISE_OPS else 0))
        for n in nodes
        if n.op_type == "DequantizeLinear" or n.op_type in GROUP_WISE_OPS
    ]  # fmt: skip
    blocked = [(n, size) for n, size in blocked if size]
    if not blocked:
        return
    node, size = blocked[0]
    raise LoweringError(
        f"{node.op_type} {node_name(node)!r} holds group-wise weights (block_size {size}"
        f"{f'; {len(blocked)} such nodes' if len(blocked) > 1 else ''}): an integer-only "
        "program rescales each output channel's int32 sum with one fixed-point multiplier, "
        "and the blocks of one channel have different scales, so there is no such multiplier. "
        "Lower a per-channel model instead: quantize the float model with int8 activations and "
        "per-channel weights (qb.quantize, or `quantbridge quantize FLOAT.onnx --calib "
        "CALIB.npz`) and lower that file"
    )


def _refuse_weight_only(model: onnx.ModelProto) -> None:
    """A weight-only model (integer weights, no quantized activation: NNCF's compress_weights
    INT8) has no integer-only program: LoweringError naming its first weight reader and the fix."""
    readers = weight_only_readers(model)
    if readers:
        raise LoweringError(
            f"{readers[0].op_type} {node_name(readers[0])!r} dequantizes an integer weight, and "
            f"the model quantizes no activation ({len(readers)} integer weights, float "
            "activations: weight-only compression such as NNCF's compress_weights), so there is "
            "no integer-only program to lower. Run it as it is in ONNX Runtime, or quantize the "
            "float model statically with int8 activations (qb.quantize, or `quantbridge quantize "
            "FLOAT.onnx --calib CALIB.npz`) and lower that file"
        )


def _contrib_fix(nodes, missing: dict[str, list[str]]) -> str:
    """The fix for ONNX Runtime contrib ops that neither unfold nor lower (QAttention, ...)."""
    contrib = sorted({n.op_type for n in nodes if n.domain == MS_DOMAIN and n.op_type in missing})
    if not contrib:
        return ""
    return (
        f". {', '.join(contrib)} (com.microsoft) are ONNX Runtime contrib ops with no QDQ form "
        f"here (unfolded: {', '.join(sorted(unfoldable_ops()))}): quantize the float model in "
        "QDQ form instead (`quantbridge quantize FLOAT.onnx --calib CALIB.npz`, or onnxruntime's "
        "quantize_static with quant_format=QuantFormat.QDQ) and lower that file"
    )


def _graph_inputs(graph: onnx.GraphProto) -> dict[str, Value]:
    env: dict[str, Value] = {}
    initializers = {i.name for i in graph.initializer}
    for vi in graph.input:
        if vi.name in initializers:
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        integer = np.issubdtype(dtype, np.integer) or np.dtype(dtype) == bool
        env[vi.name] = IntInput(vi.name, np.dtype(dtype)) if integer else FloatInput(vi.name)
    for init in graph.initializer:
        env[init.name] = Const(numpy_helper.to_array(init))
    return env


def lower(
    src: str | os.PathLike | onnx.ModelProto,
    *,
    accumulator_bits: int = 32,
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    float_outputs: str = "dequantize",
) -> IntegerProgram:
    """Lower a quantized ONNX model (QDQ; QLinearConv/QLinearMatMul/ConvInteger/MatMulInteger;
    ONNX Runtime's contrib QLinearAdd, QGemm, QLinearConcat ... ``onnx.passes.unfoldable_ops``)
    to an integer-only program.

    ``accumulator_bits`` (32 or 64): layers whose accumulator could exceed it (bound from the
    integer weights and the input code ranges) are refused, all named in one error.
    ``input_shapes`` (input name -> static shape): lower for these shapes (a global average
    pool over a dynamic H x W needs them). ``float_outputs="dequantize"``: an output computed in
    float from the last codes (a final Sigmoid) becomes those codes plus a float table applied
    outside the program, a final layer norm is realized on int16 codes dequantized outside
    it, and a float output written by a weighted layer (logits of
    ``Recipe(quantize_outputs=False)``) is the layer's int32 accumulator with its float32
    scale in ``Boundary.scale`` (``lowering._outputs``). That is the default, since
    ``qb.quantize``'s default recipe keeps the logits float; ``float_outputs="refuse"``
    refuses them all (for a program whose outputs must all be codes).
    LoweringError (a ValueError) for float models, ops with no lowering, mismatched Q/DQ pairs.
    """
    if accumulator_bits not in (32, 64):
        raise ValueError(f"accumulator_bits must be 32 or 64, got {accumulator_bits}")
    model = with_input_shapes(_load(src), input_shapes)
    shapes = _shapes(model)  # before: a LayerNormalization below opset 17 stops inference
    model = fuse_decomposed_layer_norms(model, shapes)
    _check(model)
    graph = model.graph
    env = _graph_inputs(graph)
    b = Builder(accumulator_bits, shapes)
    b.ours = any(t.name.startswith("_quantbridge.") for t in graph.initializer)
    b.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 21)
    for name in [t for n in graph.node for t in n.input] + [o.name for o in graph.output]:
        b.readers[name] = b.readers.get(name, 0) + 1
    for node in graph.node:
        if node.op_type == "Constant":
            env[node.output[0]] = Const(numpy_helper.to_array(node.attribute[0].t))
            continue
        ins = [env[i] if i else None for i in node.input]
        outs = LOWERINGS[node.op_type](b, node, ins)
        env.update(zip(node.output, outs, strict=False))
        for name, v in zip(node.output, outs, strict=False):
            if isinstance(v, QValue | IndexValue):
                b.onnx_tensors[name] = v.tensor.name
    outputs = graph_outputs(graph, env, float_outputs, b)
    if b.overflows:
        raise LoweringError(
            f"{len(b.overflows)} layers could overflow their int{accumulator_bits} accumulator: "
            + "; ".join(b.overflows)
            + ". Lower with accumulator_bits=64 to accept a wider accumulator."
        )
    shapes = {b_.name: b.shapes.get(b_.name) for b_ in b.inputs}
    return IntegerProgram(
        b.inputs, outputs, b.steps, b.tensors, b.constants, b.onnx_tensors, shapes
    )


__all__ = ["LoweringError", "lower"]
