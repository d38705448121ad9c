"""Cases 10 and 11 of the fold (``__init__``): average pooling.

* Case 10: ``AveragePool`` -> ``QLinearAveragePool`` (com.microsoft; attributes copied);
* Case 11: ``GlobalAveragePool``, or ``ReduceMean`` over every spatial axis (2 .. rank-1) of an
  NC... tensor, -> ``QLinearGlobalAveragePool`` (com.microsoft, channels first); a ReduceMean
  with ``keepdims=0`` is followed by a ``Flatten(axis=1)`` of the integers (N, C, 1, ..., 1) ->
  (N, C).

MaxPool is data movement (Case 1-2, ``_normalize``), not here.
"""

from __future__ import annotations

import onnx

from ._graph import MS_DOMAIN, GraphView, Rewrite, attribute, attributes, node
from ._match import one_type, operands, q_input, q_output
from ._registry import register_fold


def _qlinear_pool(g: GraphView, op: onnx.NodeProto, qop: str, output: str, **attrs):
    x, out = q_input(g, op.input[0]), q_output(g, op)
    if x is None or out is None or not one_type(x.params, out.params):
        return None
    names, inits = operands(g, x.params, out.params)
    (xs, xz), (ys, yz) = names
    pool = node(
        qop,
        [x.tensor, xs, xz, ys, yz],
        [output or out.tensor],
        g.fresh(op.name or qop),
        domain=MS_DOMAIN,
        **attrs,
    )
    return pool, out, inits


# Case 10
@register_fold("AveragePool")
def fold_average_pool(g: GraphView, pool: onnx.NodeProto) -> Rewrite | None:
    """Case 10: DQ -> AveragePool -> Q  ==>  QLinearAveragePool."""
    found = _qlinear_pool(g, pool, "QLinearAveragePool", "", **attributes(pool))
    if found is None:
        return None
    qpool, out, inits = found
    return Rewrite([pool, *out.nodes], [qpool], inits)


# Case 11
@register_fold("GlobalAveragePool")
def fold_global_average_pool(g: GraphView, pool: onnx.NodeProto) -> Rewrite | None:
    """Case 11: DQ -> GlobalAveragePool -> Q  ==>  QLinearGlobalAveragePool."""
    found = _qlinear_pool(g, pool, "QLinearGlobalAveragePool", "", channels_last=0)
    if found is None:
        return None
    qpool, out, inits = found
    return Rewrite([pool, *out.nodes], [qpool], inits)


def _reduced_axes(g: GraphView, mean: onnx.NodeProto) -> list[int] | None:
    if len(mean.input) > 1 and mean.input[1]:
        axes = g.array(mean.input[1])
        return None if axes is None else [int(a) for a in axes.ravel()]
    return attribute(mean, "axes")


# Case 11
@register_fold("ReduceMean")
def fold_reduce_mean(g: GraphView, mean: onnx.NodeProto) -> Rewrite | None:
    """Case 11: DQ -> ReduceMean(spatial axes) -> Q  ==>  QLinearGlobalAveragePool [-> Flatten]."""
    rank, axes = g.rank(mean.input[0]), _reduced_axes(g, mean)
    if rank is None or rank < 3 or axes is None:
        return None
    if sorted(a % rank for a in axes) != list(range(2, rank)):
        return None
    keepdims = attribute(mean, "keepdims", 1)
    pooled = "" if keepdims else g.fresh(mean.output[0] + "_pooled")
    found = _qlinear_pool(g, mean, "QLinearGlobalAveragePool", pooled, channels_last=0)
    if found is None:
        return None
    qpool, out, inits = found
    added = [qpool]
    if not keepdims:
        added.append(
            node("Flatten", [pooled], [out.tensor], g.fresh(mean.name or "flatten"), axis=1)
        )
    return Rewrite([mean, *out.nodes], added, inits)
