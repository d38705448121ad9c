"""``import_onnx``: an fp32 ONNX model as an ordinary, trainable ``torch.nn.Module``.

The result computes what the ONNX graph computes, with torch ops, in the graph's topological
order; ``qb.quantize`` captures it with ``torch.export`` like any hand-written model. How the
graph is laid out in torch:

* weights of Conv / ConvTranspose / Gemm / MatMul (constant 2-D right operand) /
  BatchNormalization / LayerNormalization become real submodules (``nn.Conv2d``, ``nn.Linear``,
  ...) named after their ONNX node (``p2o.Conv.0`` -> ``p2o_Conv_0``; the first output's name
  when the node has none), so placement quantizes them as it does hand-written layers, and recipe
  rules match those names;
* other constants become buffers, except size-1 constants of elementwise ops (python scalars:
  ``x * 0.5``) and constants read as values (shapes, axes, scales, clip bounds);
* shape arithmetic (``Shape -> Gather -> Concat -> Reshape``) runs on python ints, or SymInts
  under ``torch.export``: dynamic batch and image sizes capture without tensors for sizes.

Rewrites done while importing (each keeps the computation; the float results equal ONNX
Runtime's up to float32 rounding):

* Case 1 - constant folding: nodes whose inputs are all constants are computed once
  (``Reshape(bias, [1, C, 1, 1])``, ``ConstantOfShape`` weights).
* Case 2 - bias absorption: ``Conv``/``ConvTranspose``/``MatMul``/``Gemm`` followed only by
  ``Add`` of a per-output-channel constant (Paddle and older exporters emit the bias that way)
  becomes the layer's bias, so it is quantized to int32 with the layer.
* Case 3 - dead code: nodes no output depends on are dropped.

Quantized graphs (QDQ, QOperator, dynamic) are first normalised to a float graph plus the file's
quantization record (``_quantized``, ``_qoperator``) and come back as a ``QuantModel`` (``_qmodel``).

Refused, with the reason and the fix: ops outside the registry (``supported_ops``), custom domains, and attribute combinations without an
exact torch equivalent. The module is returned in eval mode (as ONNX models run); ``.train()``
makes BatchNorm use batch statistics, as any torch model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import external_data_helper, numpy_helper
from torch import nn

from ...optables import is_quantized_op
from ...torch._model import QuantModel
from .._load import parse_onnx
from .._qonnx import qonnx_to_qcdq
from . import (  # noqa: F401 - registries
    _cast,
    _dynamic,
    _index,
    _nbits,
    _nn,
    _ops,
    _pool,
    _qdq,
    _qoperator,
    _recurrent,
    _tensor,
)
from ._const_quantize import fold_constant_quantize
from ._fp16 import widen_float16
from ._module import OnnxModule, new_module
from ._qmodel import quant_model
from ._quantized import RULES, SITE_DOMAIN, is_quantized, normalise
from ._registry import OnnxNode, OpHandler, as_tensor, lookup, supported_ops
from ._site import DYNAMIC_SITE_HANDLER, SITE_HANDLER
from ._symbolic import check_at_import
from ._weight_layout import sink_weight_layout

_DEFAULT_DOMAINS = ("", "ai.onnx")
_RANDOM_OPS = {
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
}


def import_onnx(
    model: str | os.PathLike | onnx.ModelProto | bytes,
    *,
    example_inputs: Any = None,
    learn_scales: bool = False,
    check_dynamic: bool = True,
) -> OnnxModule | QuantModel:
    """An ONNX model (a path, a ``ModelProto`` or its bytes) as a trainable torch model.

    A float model gives a float ``nn.Module`` (see the module docstring for the layout). A
    quantized model (QDQ, QOperator, or both) gives a ``QuantModel``, as ``quantize`` returns,
    whose quantizers hold the file's scales and zero points (frozen; ``learn_scales=True`` makes
    them learnable, LSQ) and whose weights are the file's dequantized integers (``_quantized``,
    ``_qmodel``). ``example_inputs`` (a tensor, tuple or dict, as a calibration batch) is needed
    for quantized models whose inputs have free dimensions besides the batch.
    A float16 graph (NVIDIA ModelOpt's default mode, quantized or not) is imported in float32,
    quantization grids kept exactly, with a ``Float16GraphWarning`` (``_fp16``): layers are built
    in float32, where standard optimizers train them (Adam's eps is 0 in float16).

    Raises ``ValueError`` naming the ONNX node, the op and its opset for anything it cannot import
    exactly; unsupported ops of a quantized model are listed together.

    A float model whose file declares dynamic dimensions is run once on fake tensors
    (``check_dynamic``, ``_symbolic.check_at_import``): a ``DynamicDimensionWarning`` names each
    node that would pin such a dimension to the example's size. ``example_inputs`` gives the
    sizes to try (default 2 for the batch, 64 + i for other free dimensions).
    """
    proto = qonnx_to_qcdq(_load(model))  # QONNX's Quant op (Brevitas, FINN) as Q -> Clip -> DQ
    proto = widen_float16(proto)  # ModelOpt's float16 graphs, read as float32 (warns)
    if is_quantized(proto):
        proto = fold_constant_quantize(proto)  # float weights quantized at run time: their codes
        proto = sink_weight_layout(proto)  # DQ(W^T) -> Transpose -> MatMul: W's codes moved
        normalised, record = normalise(proto, _ranks(proto))
        graph, module = _float_module(normalised, frozenset(record.weights))
        return quant_model(module, graph, record, proto, example_inputs, learn_scales)
    module = _float_module(proto)[1]
    if check_dynamic:
        check_at_import(module, proto, _named_examples(module, example_inputs))
    return module


def _named_examples(module: OnnxModule, example_inputs: Any) -> dict[str, Any] | None:
    """``example_inputs`` (a tensor, tuple or dict) keyed by the graph's input names."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, dict):
        return dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    return dict(zip(module.input_names, example_inputs, strict=False))


def _float_module(
    proto: onnx.ModelProto, integer_consts: frozenset[str] = frozenset()
) -> tuple[_Graph, OnnxModule]:
    """The float module of ``proto``; ``integer_consts`` (constants the file stores as integers)
    stay buffers even when size 1, so the quantized import can put them on the file's grid."""
    graph = _Graph(proto)
    graph.refuse_unsupported()
    graph.fold_constants()  # Case 1
    layers = graph.build_layers()
    graph.absorb_biases(layers)  # Case 2
    graph.drop_dead_nodes()  # Case 3
    return graph, new_module(graph, layers, integer_consts)


# -- loading -------------------------------------------------------------------------------------
def _load(model) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        for init in _all_initializers(model.graph):
            if external_data_helper.uses_external_data(init) and not init.HasField("raw_data"):
                raise ValueError(
                    f"initializer {init.name!r} is stored in an external data file that this "
                    "ModelProto does not hold; pass the model's file path to import_onnx so onnx "
                    "loads the data from the model's folder"
                )
        return model
    if isinstance(model, bytes):
        return _parse(lambda: onnx.load_from_string(model), f"<{len(model)} bytes>")
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.is_file():
            raise ValueError(f"import_onnx: no ONNX file at {str(path)!r}")
        # external data is loaded from the model's folder
        return _parse(lambda: onnx.load(str(path)), repr(str(path)))
    raise TypeError(
        f"import_onnx expects a path, an onnx.ModelProto or its bytes, got {type(model).__name__}"
    )


def _parse(load, what: str) -> onnx.ModelProto:
    return parse_onnx(load, what, "import_onnx")


def _all_initializers(graph: onnx.GraphProto):
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    out = {}
    for attr in node.attribute:
        value = onnx.helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode() for v in value]
        out[attr.name] = value
    return out


def _constant_value(node: onnx.NodeProto, attrs: dict) -> np.ndarray:
    for key, dtype in (("value_float", np.float32), ("value_int", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    for key, dtype in (("value_floats", np.float32), ("value_ints", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    if "value" in attrs:
        return np.asarray(attrs["value"])
    raise ValueError(
        f"ONNX node {node.name!r} (op Constant): {sorted(attrs)} constants (sparse or string) "
        "are not supported by quantbridge.import_onnx"
    )


def _ranks(proto: onnx.ModelProto) -> dict[str, int]:
    """Rank of every value shape inference can tell (empty when it fails, e.g. > 2 GB)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # noqa: BLE001 - ranks are a convenience; handlers fall back to x.ndim
        return {}
    g = inferred.graph
    ranks = {}
    for v in list(g.value_info) + list(g.input) + list(g.output):
        t = v.type.tensor_type
        if t.HasField("shape"):
            ranks[v.name] = len(t.shape.dim)
    return ranks


# -- the graph while importing -------------------------------------------------------------------
class _Graph:
    """Nodes (topologically sorted, Constant nodes moved into ``consts``), constants, the graph's
    inputs and outputs, and the passes of the import (see the module docstring)."""

    def __init__(self, proto: onnx.ModelProto):
        self.proto = proto
        g = proto.graph
        self.opsets = {o.domain or "": o.version for o in proto.opset_import}
        self.opsets.setdefault("", self.opsets.get("ai.onnx", 1))
        self.consts = {i.name: numpy_helper.to_array(i) for i in g.initializer}
        self.inputs = [i.name for i in g.input if i.name not in self.consts]
        self.outputs = [o.name for o in g.output]
        ranks = _ranks(proto)
        self.nodes = []
        names: set[str] = set()
        for index, node in enumerate(g.node):
            attrs = _attributes(node)
            if node.op_type == "Constant" and node.domain in _DEFAULT_DOMAINS:
                self.consts[node.output[0]] = _constant_value(node, attrs)
                continue
            domain = "" if node.domain in _DEFAULT_DOMAINS else node.domain
            name = node.name or node.output[0] or f"{node.op_type}_{index}"
            if name in names:  # node names should be unique; layers are keyed by them
                name = f"{name}_{index}"
            names.add(name)
            self.nodes.append(
                OnnxNode(
                    name=name,
                    op_type=node.op_type,
                    opset=self.opsets.get(domain, 0),
                    inputs=list(node.input),
                    outputs=list(node.output),
                    attrs=attrs,
                    ranks=tuple(ranks.get(i) for i in node.input),
                    domain=domain,
                )
            )
        self.nodes = _topological(self.nodes, set(self.inputs) | set(self.consts))

    def handler(self, node: OnnxNode) -> OpHandler | None:
        if node.domain == SITE_DOMAIN:
            return DYNAMIC_SITE_HANDLER if node.op_type == "DynamicSite" else SITE_HANDLER
        return lookup(node.op_type, node.opset) if node.domain == "" else None

    def refuse_unsupported(self) -> None:
        for node in self.nodes:
            if is_quantized_op(node.op_type):
                raise ValueError(
                    f"{node.where()} is a quantized operator quantbridge.import_onnx does not "
                    f"import (quantized ops it imports: {', '.join(sorted(RULES))}). Import the "
                    "fp32 model and quantize it with quantbridge.quantize"
                )
        missing = [n for n in self.nodes if self.handler(n) is None]
        if missing:
            node = missing[0]
            where = node.where() if not node.domain else f"{node.where()} in domain {node.domain!r}"
            others = sorted({f"{n.domain + '.' if n.domain else ''}{n.op_type}" for n in missing})
            raise ValueError(
                f"{where}: not supported by quantbridge.import_onnx; supported ops: "
                f"{', '.join(supported_ops())}. Unsupported ops in this model: {', '.join(others)}. "
                "Re-export the model without them (another opset or exporter option), or keep "
                "that part of the model outside the import"
            )
        for node in self.nodes:
            check = self.handler(node).check
            if check is not None:
                check(node)

    # Case 1
    def fold_constants(self) -> None:
        kept = []
        for node in self.nodes:
            inputs = [i for i in node.inputs if i]
            if (node.op_type in _RANDOM_OPS or node.domain == SITE_DOMAIN  # a quantizer stays
                    or not all(i in self.consts for i in inputs)):  # fmt: skip
                kept.append(node)
                continue
            values = [self.consts[i] if i else None for i in node.inputs]
            outputs = _evaluate(self.handler(node), node, values)
            for name, value in zip(node.outputs, outputs, strict=False):
                if name:
                    self.consts[name] = value
        self.nodes = kept

    def build_layers(self) -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
        layers = {}
        for node in self.nodes:
            spec = self.handler(node).layer
            built = spec.build(node, self.consts) if spec is not None else None
            if built is not None:
                layers[node.name] = built
        return layers

    def consumers(self) -> dict[str, list[OnnxNode]]:
        users: dict[str, list[OnnxNode]] = {}
        for node in self.nodes:
            for i in node.inputs:
                users.setdefault(i, []).append(node)
        return users

    # Case 2
    def absorb_biases(self, layers: dict) -> None:
        users = self.consumers()
        dropped = set()
        for node in self.nodes:
            if node.name not in layers or node.name in dropped:
                continue
            module, consumed = layers[node.name]
            out = node.outputs[0]
            add = users.get(out, [])
            if len(add) != 1 or add[0].op_type != "Add" or out in self.outputs:
                continue
            if len(node.inputs) > 2 and node.inputs[2] and 2 not in consumed:
                continue  # a run-time Gemm C is added after the layer already
            add = add[0]
            position = 0 if add.inputs[0] == out else 1
            other = add.inputs[1 - position]
            bias = self.consts.get(other)
            if bias is None or not _absorb(module, bias, add.ranks[position]):
                continue
            node.outputs[0] = add.outputs[0]
            layers[node.name] = (module, tuple(sorted(set(consumed) | {2})))
            dropped.add(add.name)
        self.nodes = [n for n in self.nodes if n.name not in dropped]

    # Case 3
    def drop_dead_nodes(self) -> None:
        live = set(self.outputs)
        kept = []
        for node in reversed(self.nodes):
            if any(o in live for o in node.outputs if o):
                kept.append(node)
                live.update(i for i in node.inputs if i)
        self.nodes = kept[::-1]


def _topological(nodes: list[OnnxNode], known: set[str]) -> list[OnnxNode]:
    known, pending, ordered = set(known) | {""}, list(nodes), []
    while pending:
        ready = [n for n in pending if all(i in known for i in n.inputs)]
        if not ready:
            missing = sorted({i for n in pending for i in n.inputs if i not in known})[:5]
            raise ValueError(
                f"the ONNX graph is not a DAG of known values: node {pending[0].name!r} needs "
                f"{missing}, which no node, input or initializer produces"
            )
        ready_ids = {id(n) for n in ready}
        ordered += ready
        pending = [n for n in pending if id(n) not in ready_ids]
        for n in ready:
            known.update(n.outputs)
    return ordered


def _evaluate(handler: OpHandler, node: OnnxNode, values: list) -> list[np.ndarray]:
    """Run one node on constant inputs (numpy in, numpy out)."""
    if handler.host is not None:
        out = handler.host(node, *values)
    else:
        args = [
            v if i in handler.static or v is None else as_tensor(v) for i, v in enumerate(values)
        ]
        with torch.no_grad():
            out = handler.fn(node, *args)
    outs = out if isinstance(out, tuple) else (out,)
    return [o.numpy() if isinstance(o, torch.Tensor) else np.asarray(o) for o in outs]


def _absorb(module: nn.Module, bias: np.ndarray, out_rank: int | None) -> bool:
    """Case 2: add ``bias`` (a per-output-channel constant) to the layer's bias, if it is one."""
    if isinstance(module, nn.modules.conv._ConvNd):
        channels, rank, axis = module.out_channels, module.weight.ndim, 1
    elif isinstance(module, nn.Linear):
        channels, rank = module.out_features, out_rank
        if rank is None:  # unknown output rank: only a 1-D bias keeps the output's shape
            rank = 1 if bias.ndim <= 1 else 0
        axis = rank - 1
    else:
        return False
    if bias.ndim > rank or not np.issubdtype(bias.dtype, np.floating):
        return False
    shape = (1,) * (rank - bias.ndim) + bias.shape
    if any(d != 1 for i, d in enumerate(shape) if i != axis) or shape[axis] not in (1, channels):
        return False
    values = torch.from_numpy(np.broadcast_to(bias.reshape(-1), (channels,)).copy())
    if module.bias is None:
        module.bias = nn.Parameter(values.to(module.weight.dtype))
    else:
        with torch.no_grad():
            module.bias += values.to(module.bias.dtype)
    return True
