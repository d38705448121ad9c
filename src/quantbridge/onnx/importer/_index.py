"""Indexed ops of ``import_onnx``: ScatterND (Swin's attention mask), GatherND (the attention
mask of a torch SDPA export), CumSum
(EdgeNeXt's positional encoding).

* ``ScatterND(data, indices, updates)``: ``indices[..., :k]`` address the first ``k`` dimensions
  of ``data``; the result is ``data`` with those slices replaced by ``updates`` (``index_put``),
  or added to them with ``reduction="add"`` (opset 16). Other reductions are refused at import.
  Negative indices count from the end, as in python (opset 18 documents them).
* ``GatherND(data, indices, batch_dims=b)``: the first ``b`` dimensions of both are batch; each
  row ``indices[..., :k]`` picks ``data[batch, i0, .., ik-1]`` (a slice when ``k`` is short of the
  rank); negative indices count from the end (torch's advanced indexing, as ONNX specifies).
* ``CumSum(x, axis)``: ``exclusive=1`` shifts the running sum by one (the first element is 0),
  ``reverse=1`` sums from the end; both are done by moving elements, never by subtracting, so
  the float results are ``torch.cumsum``'s.
"""

from __future__ import annotations

import torch

from ._registry import OnnxNode, as_tensor, ints, register

_SCATTER_REDUCTIONS = ("none", "add")


def _check_scatter(node: OnnxNode) -> None:
    reduction = node.attr("reduction", "none")
    if reduction not in _SCATTER_REDUCTIONS:
        raise ValueError(
            f"{node.where()}: reduction={reduction!r} is not supported by quantbridge.import_onnx "
            f"(supported: {', '.join(_SCATTER_REDUCTIONS)}); re-export with an index assignment "
            "or addition"
        )


@register("ScatterND", since=11, check=_check_scatter)
def _scatter_nd(node, data, indices, updates):
    data, indices, updates = as_tensor(data), as_tensor(indices).long(), as_tensor(updates)
    depth = indices.shape[-1]
    index = tuple(indices[..., i] for i in range(depth))
    accumulate = node.attr("reduction", "none") == "add"
    return torch.index_put(data, index, updates.to(data.dtype), accumulate=accumulate)


@register("GatherND", since=11)
def _gather_nd(node, data, indices):
    data, indices = as_tensor(data), as_tensor(indices).long()
    b = node.attr("batch_dims", 0)
    k = indices.shape[-1]
    batch = tuple(data.shape[:b])
    flat = data.reshape(-1, *data.shape[b:])  # (B, ...)
    idx = indices.reshape(flat.shape[0], *indices.shape[b:-1], k)
    rows = torch.arange(flat.shape[0]).reshape(-1, *([1] * (idx.ndim - 2)))
    picked = flat[(rows, *(idx[..., j] for j in range(k)))]
    return picked.reshape(*batch, *indices.shape[b:-1], *data.shape[b + k :])


@register("CumSum", since=11, static=(1,))
def _cumsum(node, x, axis):
    x = as_tensor(x)
    dim = ints(axis)[0]
    dim = dim + x.ndim if dim < 0 else dim
    if node.attr("reverse", 0):
        x = x.flip(dim)
    out = torch.cumsum(x, dim)
    if node.attr("exclusive", 0):
        zero = torch.zeros_like(x.narrow(dim, 0, 1))
        out = torch.cat([zero, out.narrow(dim, 0, x.shape[dim] - 1)], dim)
    return out.flip(dim) if node.attr("reverse", 0) else out
