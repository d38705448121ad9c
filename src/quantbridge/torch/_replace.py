"""Layers replaced after quantization: transfer learning on a ``QuantModel``.

``qmodel.fc = nn.Linear(512, 5)`` (or ``qmodel.layer4[1].conv2 = nn.Conv2d(...)``, or a head of an
imported ONNX model, named after its node) swaps the module whose parameters the captured graph
reads by name (``fc.weight``, ``fc.bias``). The graph follows the new parameters, but the layer's
quantizers were set for the old ones. ``adopt_replaced_layers`` runs before every call (a forward
pre-hook of ``QuantModel``) and before export; for each weight whose shape changed since the
quantizers were set (``WeightQuantizer.weight_shape``) it:

* checks the new layer fits the graph: only the output channels (the op's output axis, as
  ``WEIGHTED_OPS`` has it) may differ, a conv keeps the graph's stride / padding / dilation /
  groups, and a bias the graph reads must exist. Otherwise one ``ValueError`` naming the layer and
  the fix;
* sets the weight quantizer from the new weight, following it from then on as in QAT (a learned,
  LSQ, quantizer keeps learning, from the new weight's range). Its per-channel parameters take the
  new channel count; the int32 bias follows (``BiasQuantizer`` derives its scale);
* makes every activation quantizer downstream of the layer, up to the next weighted layer (the
  layer's output grid, and those of pooling or adds after it), follow the new layer's range by a
  moving average in training mode (``Quantizer.track``, fresh statistics), unless it is learned
  (LSQ adapts it) or still calibrating. The old head's ranges say nothing about the new one.

A replacement with the same shape is not detected: its quantizers keep their parameters (copy the
new values in and they still fit, or re-quantize).
"""

from __future__ import annotations

import torch
from torch import nn

from ._fakequant import BiasQuantizer, QState, Quantizer, WeightQuantizer
from ._ops import WEIGHTED_OPS
from ._placement import CONTAINER

_CONV_DEFAULTS = {3: 1, 4: 0, 5: 1, 6: 1}  # aten.conv*d: stride, padding, dilation, groups


def record_weight_shapes(qmodel: nn.Module) -> None:
    """Remember each quantized weight's shape (what its quantizer's parameters were set for),
    and on each ``get_attr`` node without a captured value (a bias that batch-norm folding
    added) the shape and dtype the graph was built for: ``meta["qb_shape"]``, read by export's
    one-trace check (``onnx.exporter._reuse``)."""
    for wq in _weight_quantizers(qmodel):
        param = _parameter(qmodel, wq.weight_name)
        if param is not None and "weight_shape" not in wq.__dict__:  # a copy keeps the original's
            wq.weight_shape = tuple(param.shape)
    for node in qmodel.graph.nodes:
        if node.op == "get_attr" and not {"val", "qb_shape"} & node.meta.keys():
            tensor = _parameter(qmodel, node.target)
            if tensor is not None:
                node.meta["qb_shape"] = (tuple(tensor.shape), tensor.dtype)


def adopt_replaced_layers(qmodel: nn.Module) -> None:
    """Re-set the quantizers of every layer replaced since the last call (module docstring)."""
    for wq in _weight_quantizers(qmodel):
        param = _parameter(qmodel, wq.weight_name)
        seen = wq.__dict__
        if param is None or param is seen.get("_weight_seen"):
            continue  # the same tensor as last time (trained in place): nothing replaced
        seen["_weight_seen"] = param
        old = seen.get("weight_shape")
        if old is not None and tuple(param.shape) != old:
            _adopt(qmodel, wq, param, old)


def adopt_hook(module: nn.Module, args) -> None:
    """``register_forward_pre_hook(adopt_hook)``. Not while tracing (``torch.export``,
    ``torch.compile``): the parameters are stand-ins then, and export adopts before tracing."""
    if torch.compiler.is_compiling():
        return
    adopt_replaced_layers(module)


def _weight_quantizers(qmodel: nn.Module) -> list[WeightQuantizer]:
    container = qmodel._modules.get(CONTAINER)
    if container is None:
        return []
    return [
        m
        for m in container._modules.values()
        if isinstance(m, WeightQuantizer) and getattr(m, "weight_name", "")
    ]


def _parameter(qmodel: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter (or buffer) at ``name``, by the module dictionaries: this runs before every
    call, and ``get_submodule`` costs 50x more."""
    *path, attr = name.split(".")
    module = qmodel
    for part in path:
        module = module._modules.get(part)
        if module is None:
            return None
    found = module._parameters.get(attr)
    return found if found is not None else module._buffers.get(attr)


def _adopt(qmodel: nn.Module, wq: WeightQuantizer, w: torch.Tensor, old: tuple) -> None:
    layer = wq.weight_name.rpartition(".")[0]
    op = _op_of(qmodel, wq)
    out_axis = WEIGHTED_OPS[op.target][3] if op is not None else 0
    new = tuple(w.shape)
    if len(new) != len(old) or any(
        a != b for i, (a, b) in enumerate(zip(new, old, strict=True)) if i != out_axis
    ):
        raise ValueError(
            f"layer {layer!r} was replaced by one with weight shape {list(new)}; the captured "
            f"graph feeds it inputs for weight shape {list(old)}: only dimension {out_axis} (the "
            "output channels) may change. Keep the layer's input size (and kernel size)"
        )
    if op is not None:
        _check_conv(layer, qmodel.get_submodule(layer), op)
        _check_bias(qmodel, layer, op)
    with torch.no_grad():
        wq.compute_from(w)
    if wq.qstate is not QState.LEARNED:
        wq.observing = True  # follow the weight, as in QAT
    wq.weight_shape = new
    if op is not None:
        for q in _downstream_quantizers(qmodel, op):
            if q.qstate in (QState.FROZEN, QState.TRACKING):
                q.tracker = None
                q.track()


def _op_of(qmodel: nn.Module, wq: WeightQuantizer) -> torch.fx.Node | None:
    """The weighted op that reads this quantizer's output."""
    for node in qmodel.graph.nodes:
        if node.op == "call_module" and qmodel.get_submodule(node.target) is wq:
            for user in node.users:
                if user.op == "call_function" and user.target in WEIGHTED_OPS:
                    return user
    return None


def _check_conv(layer: str, module: nn.Module, op: torch.fx.Node) -> None:
    if not isinstance(module, nn.modules.conv._ConvNd) or isinstance(module.padding, str):
        return
    rank = len(module.kernel_size)
    graph = {i: op.args[i] if len(op.args) > i else _CONV_DEFAULTS.get(i) for i in range(3, 7)}
    ours = {3: module.stride, 4: module.padding, 5: module.dilation, 6: module.groups}
    names = {3: "stride", 4: "padding", 5: "dilation", 6: "groups"}
    for i, value in ours.items():
        expected = graph[i]
        if i != 6 and not isinstance(expected, (list, tuple)):
            expected = [expected] * rank
        if i != 6 and len(expected) == 1:
            expected = list(expected) * rank
        if (list(value) if i != 6 else value) != (list(expected) if i != 6 else expected):
            raise ValueError(
                f"layer {layer!r} was replaced by a conv with {names[i]}={value}, but the "
                f"captured graph runs it with {names[i]}={expected}: only the output channels "
                "may change; keep the other settings"
            )


def _check_bias(qmodel: nn.Module, layer: str, op: torch.fx.Node) -> None:
    i_b = WEIGHTED_OPS[op.target][2]
    b = op.args[i_b] if len(op.args) > i_b else None
    while isinstance(b, torch.fx.Node) and b.op == "call_module":
        if not isinstance(qmodel.get_submodule(b.target), BiasQuantizer):
            break
        b = b.args[0]
    if isinstance(b, torch.fx.Node) and b.op == "get_attr" and _parameter(qmodel, b.target) is None:
        raise ValueError(
            f"layer {layer!r} was replaced by one without a bias, but the captured graph adds "
            f"'{b.target}': create the new layer with bias=True"
        )


def _downstream_quantizers(qmodel: nn.Module, op: torch.fx.Node) -> list[Quantizer]:
    """Activation quantizers reached from ``op`` without passing another weighted op."""
    found, seen, todo = [], set(), list(op.users)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and node.target in WEIGHTED_OPS:
            continue
        if node.op == "call_module" and str(node.target).startswith(CONTAINER + "."):
            q = qmodel.get_submodule(node.target)
            if isinstance(q, Quantizer) and q.kind == "activation" and q not in found:
                found.append(q)
        todo.extend(node.users)
    return found
