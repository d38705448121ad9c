"""Mixture-of-experts weights stacked in one parameter (HF transformers 5.x with
``experts_implementation='batched_mm'``: Mixtral, Qwen2-MoE, Qwen3-MoE): a parameter ``W`` of
shape ``[E, O, K]`` (``[E, K, O]`` when transposed) is read per token by index, ``W[expert_ids]``,
then multiplied by ``bmm``. This module finds those reads in a captured graph; placement
(``_place_experts``) puts one weight quantizer on the parameter itself, before the gather, with
one scale per (expert, output channel) (``_fakequant.StackedWeightQuantizer``).

Why before the gather: fake-quantization is elementwise with a scale per row ``(e, o)``, and the
gather copies whole rows, so ``fq(W)[ids] == fq(W[ids])`` exactly; the quantized model and its
export (``DequantizeLinear(int8 [E*O, K], axis 0) -> Reshape [E, O, K] -> Gather -> MatMul``)
compute the same numbers. The output channel ``O`` is the parameter axis the product does not
contract (``bmm(a, b)`` contracts ``a``'s last axis and ``b``'s second-to-last), followed back
through the transposes between the product and the index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

aten = torch.ops.aten

# products that may read a stacked weight, and the views allowed between the index and them
STACKED_PRODUCT_OPS: frozenset = frozenset({aten.bmm.default, aten.matmul.default})


@dataclass(frozen=True)
class StackedRead:
    param: torch.fx.Node  # the get_attr of the [E, O, K] parameter
    index: torch.fx.Node  # ``param[ids]``: the one op reading the parameter
    operand: torch.fx.Node  # the product's operand (the index, or a transpose of it)
    out_axis: int  # the parameter's output-channel axis (1 or 2)


def _val(node):
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _param_val(node):
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"):
        return None
    val = _val(node)
    if val is None:
        try:
            val = node.graph.owning_module.get_parameter(node.target)
        except AttributeError:
            return None  # a buffer: no weight
    return val


def stacked_read(node: torch.fx.Node, position: int) -> StackedRead | None:
    """The stacked-expert read at operand ``position`` of product ``node``, or None."""
    operand = node.args[position] if len(node.args) > position else None
    val = _val(operand)
    if val is None or val.ndim != 3:
        return None
    dim = 2 if position == 0 else 1  # the operand's contracted axis
    a = operand
    while isinstance(a, torch.fx.Node) and a.op == "call_function":
        if a.target is aten.index.Tensor:
            break
        if a.target is aten.transpose.int:
            d0, d1 = (d % 3 for d in a.args[1:3])
            dim = {d0: d1, d1: d0}.get(dim, dim)
        elif a.target is aten.permute.default:
            dim = list(a.args[1])[dim] % 3
        else:
            return None
        a = a.args[0]
    else:
        return None
    indices = a.args[1]
    if len(indices) != 1 or _val(indices[0]) is None or _val(indices[0]).ndim != 1:
        return None  # one 1-D index tensor on axis 0: the rank and axes 1, 2 are kept
    if len(a.args[0].users) != 1 or _val(indices[0]).is_floating_point():
        return None  # the parameter read elsewhere too: left to the other rules
    param = _param_val(a.args[0])
    if param is None or param.ndim != 3 or param.dtype not in (torch.float32, torch.float64):
        return None
    if dim == 0:
        return None  # contraction over the expert axis: no expert matrix
    return StackedRead(a.args[0], a, operand, 3 - dim)


def stacked_reads(node: torch.fx.Node) -> list[StackedRead]:
    """The stacked-expert weights product ``node`` reads (empty for any other node)."""
    if node.op != "call_function" or node.target not in STACKED_PRODUCT_OPS:
        return []
    return [r for r in (stacked_read(node, 0), stacked_read(node, 1)) if r is not None]
