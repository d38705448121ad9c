"""``decompose_sdpa``: ``scaled_dot_product_attention`` written as the eager attention it computes,
so that both ways of writing attention get the same quantizer placement (issue 12, part 8).

``torch.export`` keeps ``F.scaled_dot_product_attention`` (the Hugging Face default,
``nn.MultiheadAttention``, timm ViTs) as one aten op that the placement tables do not know, so
both attention matmuls stayed float, while the same attention written out (``q @ k.T * scale``,
softmax, ``p @ v``) got an int8 QK^T. Each SDPA of the captured graph becomes::

    s = matmul(q, transpose(k, -2, -1)) * scale      # scale: the argument, else 1/sqrt(E)
    s = s + attn_mask                                 # float mask
    s = masked_fill(s, logical_not(attn_mask), -inf)  # bool mask
    s = masked_fill(s, logical_not(tril(ones(L, S))), -inf)   # is_causal
    out = matmul(softmax(s, -1), v)                   # _safe_softmax with attn_mask

which is torch's math reference up to float32 rounding (it scales q and k by sqrt(scale) each
before the product). With an ``attn_mask`` the softmax is ``aten._safe_softmax``, as in torch's
math SDPA: a query row whose keys are all masked (-inf scores: ModernBERT's sliding window over
a padded tail) gives probabilities 0, so output 0, where plain softmax gives 0/0 = NaN, which
calibration then refused as non-finite values. ``is_causal`` alone never masks a whole row
(key 0 is always kept), so it keeps plain softmax. Placement then treats it as eager attention: QK^T in int8 (both operands
have quantizers), the probabilities float (``_ops.KEEP_FLOAT_OUTPUT_OPS``), so P @ V in float.
docs/attention.md gives the measurements behind that choice per engine.

Left as captured (float, as before): ``dropout_p != 0`` (training-time attention dropout),
``enable_gqa=True``, and a head size that is not a number at capture.
"""

from __future__ import annotations

import math

import torch
from torch._guards import detect_fake_mode

from ._passes import finish

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default


def decompose_sdpa(gm: torch.fx.GraphModule) -> int:
    """Rewrite every decomposable SDPA of ``gm`` as eager attention; the count."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _SDPA and _rewrite(gm.graph, node):
            done += 1
    return finish(gm, done)


def _arguments(node: torch.fx.Node) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    out = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None}
    out["enable_gqa"] = False
    out.update(zip(names, node.args, strict=False))
    out.update(node.kwargs)
    return out


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    a = _arguments(node)
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    q_val = q.meta.get("val")
    if a["dropout_p"] or a["enable_gqa"] or not isinstance(q_val, torch.Tensor):
        return False
    head = q_val.shape[-1]
    if a["scale"] is None and not isinstance(head, int):
        return False
    scale = float(a["scale"]) if a["scale"] is not None else 1.0 / math.sqrt(head)
    fake = detect_fake_mode([q_val])
    call = _Caller(graph, node, fake)
    with graph.inserting_before(node):
        k_t = call(aten.transpose.int, k, -2, -1)
        s = call(aten.mul.Tensor, call(aten.matmul.default, q, k_t), scale)
        if mask is not None:
            if mask.meta["val"].dtype == torch.bool:
                s = call(
                    aten.masked_fill.Scalar, s, call(aten.logical_not.default, mask), -math.inf
                )
            else:
                s = call(aten.add.Tensor, s, mask)
        if a["is_causal"]:
            rows = call(aten.sym_size.int, q, q_val.ndim - 2)
            cols = call(aten.sym_size.int, k, k.meta["val"].ndim - 2)
            ones = call(aten.ones.default, [rows, cols], dtype=torch.bool, device=q_val.device)
            keep = call(aten.tril.default, ones)
            s = call(aten.masked_fill.Scalar, s, call(aten.logical_not.default, keep), -math.inf)
        softmax = aten.softmax.int if mask is None else aten._safe_softmax.default
        out = call(aten.matmul.default, call(softmax, s, -1), v)
    node.replace_all_uses_with(out)
    _reshape_views(out, _val(node))
    graph.erase_node(node)
    return True


_VIEWS_THROUGH = frozenset({aten.permute.default, aten.transpose.int, aten.slice.Tensor,
                            aten.select.int, aten.unsqueeze.default, aten.alias.default})  # fmt: skip


def _reshape_views(out: torch.fx.Node, sdpa_val) -> None:
    """The fused kernels write SDPA's output in (B, L, H, E) memory, and code after them may
    rely on it (Hugging Face Data2Vec-vision: ``out.permute(0, 2, 1, 3).contiguous().view(...)``,
    whose ``contiguous`` ``torch.export`` drops as a no-op). The decomposed P @ V is contiguous:
    a ``view`` reached through permutes and slices becomes a ``reshape`` (the same values; a
    copy where a view is impossible), so that such a graph still runs."""
    if not isinstance(sdpa_val, torch.Tensor) or sdpa_val.stride() == _val(out).stride():
        return
    stack, seen = [out], set()
    while stack:
        for user in list(stack.pop().users):
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            if user.target is aten.view.default:
                user.target = aten.reshape.default
            elif user.target in _VIEWS_THROUGH:
                stack.append(user)


class _Caller:
    """Adds ``target(*args, **kwargs)`` before the SDPA node, with its fake value in ``meta``."""

    def __init__(self, graph: torch.fx.Graph, like: torch.fx.Node, fake):
        self.graph, self.like, self.fake = graph, like, fake

    def __call__(self, target, *args, **kwargs) -> torch.fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        values = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        values = [[_val(x) for x in v] if isinstance(v, list) else v for v in values]
        if self.fake is not None:
            with self.fake:
                node.meta["val"] = target(*values, **kwargs)
        else:
            node.meta["val"] = target(*values, **kwargs)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in self.like.meta:
                node.meta[key] = self.like.meta[key]
        return node


def _val(x):
    return x.meta["val"] if isinstance(x, torch.fx.Node) else x
