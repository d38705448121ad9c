"""Range-group channel split: a conv whose output channels differ widely in range gets one int8
grid per group of channels instead of one for all (``Recipe.split_ranges``).

An activation is quantized per tensor (one scale: ONNX Runtime's ``QLinearConv`` takes one output
scale). When a conv's output channels differ ~50x in range (PP-OCRv4 det's stem: std 0.23 vs
12.4), the grid the widest channel needs rounds the narrow ones to a few levels, and a
non-homogeneous activation after it (hard-swish, ``hs(k x) != k hs(x)``) forbids moving a
per-channel scale through it (cross-layer equalization needs ReLU). Splitting is exact instead:

* the channels of conv ``C`` (groups = 1) are sorted by calibration range and cut into at most
  ``MAX_GROUPS`` contiguous groups, minimising the quantization noise the readers of the region
  see: ``sum_t sum_c R_{g,t}^2 s_c (r_{c,out} / r_{c,t})^2`` over the tensors ``t`` that get
  per-group grids (``C``'s output, the region's output), ``R_{g,t}`` the range of channel
  ``c``'s group there, ``s_c`` the readers' squared weight column norm of channel ``c`` and the
  range ratio its gain from ``t`` to the region's output; a cut is kept only where it lowers
  that sum ``GAIN`` times. (The first form, ``sum_c (R_g / r_c)^2`` on ``C``'s output, counts
  each channel's noise relative to its own range: it split off near-dead channels the readers
  hardly read, ``channel_groups`` without ``sensitivity``);
* ``C`` becomes one conv per group (its weight / bias rows), and the element-wise ops between
  ``C`` and the convs reading its result (the *region*: add / mul / div / clamp / relu ... with
  scalar constants) are copied per group, so each group's values get their own grids (with
  ``THROUGH_DEPTHWISE``, off, a depthwise conv its own activation reads is in the region too,
  copied per group with its rows, and its output is one more tensor of the cut);
* at the region's end each group is brought to one common range and the groups are concatenated:
  a depthwise reader is itself split per group with the factor ``k_g`` folded into its weight and
  bias (exact: it is linear), its result concatenated for the convs reading it; a channel-mixing
  reader gets ``x_g * k_g`` concatenated. The convs reading the concatenation take
  ``W[:, perm] / k`` (``perm`` the channel order of the concatenation): the float function is
  unchanged up to float32 rounding; the integer graph has one more conv per group.

``k_g``: ``_concat_ranges._factors`` (the readers' activation and weight rounding balanced).
"""

from __future__ import annotations

import numpy as np
import torch

from .._passes import _owner
from . import _concat_ranges as _cr
from ._concat_ranges import (
    _factors,
    _mixed_concat,
    _param,
    _part_groups,
    _rescale_concat,
    _scale_columns,
    _weight,
)
from ._graph import CONV_OPS, conv_geometry, get_tensor, groups_of, record, weight_and_bias

aten = torch.ops.aten
MAX_GROUPS = 3
# a cut must lower the readers' summed noise power GAIN times (3 dB). PP-OCRv4 det on the bench's
# data (python -m bench --quick's ocr_det, calibration repeat 0, ORT fused / node by node, the
# default preset + fold_affine + mse, 2026-12-01): reader-weighted cut, GAIN 2, 3 groups 18.89 /
# 19.54 dB (75 int8 convs for 64); GAIN 1.5, 4 groups 18.83 / 18.88; the relative cut (the first
# form) GAIN 4: 18.48 / 18.74, GAIN 1.5, 4 groups 18.31 / 18.18. With 8-bit weights: no split
# 16.01 / 15.92, GAIN 2 19.66 / 19.61, GAIN 1.5, 4 groups 19.16 / 19.17
GAIN = 2.0
# a depthwise conv its own hard-swish reads joins the region (split per group, ``_channelwise``)
# only with THROUGH_DEPTHWISE. Off: it costs PP-OCRv4 det (same runs as above, 7-bit weights):
# relative cut GAIN 4 18.48 / 18.74 -> 17.84 / 17.49 dB (81 convs), reader-weighted GAIN 2 18.89
# / 19.54 -> 17.97 / 17.99 (83); the bench row (8-bit weights + equalize), fused per repeat
# 19.96 / 19.08 / 19.85 -> 19.81 / 19.29 / 16.42 (85 convs). Why is not known (each group's
# copy adds grids on the hard-swish chain and on x_g * k_g; the cut may need the dw output's
# readers' weights, not the range ratio)
THROUGH_DEPTHWISE = False
FLOOR = 1e-3  # a channel's range counts as at least FLOOR x the widest (dead channels)
ELEMENTWISE = frozenset(
    {
        aten.add.Tensor,
        aten.sub.Tensor,
        aten.mul.Tensor,
        aten.div.Tensor,
        aten.clamp.default,
        aten.clamp_min.default,
        aten.clamp_max.default,
        aten.relu.default,
        aten.hardtanh.default,
        aten.hardswish.default,
        aten.hardsigmoid.default,
        aten.sigmoid.default,
        aten.silu.default,
        aten.tanh.default,
    }
)


def split_ranges(
    gm: torch.fx.GraphModule,
    batches,
    replay: dict | None = None,
    levels: tuple[int, int] | None = None,
) -> dict:
    """Split every conv of ``gm`` whose channel ranges on ``batches`` pay for it. Returns the
    split as data, ``{conv node name: {"groups": [[channel, ...], ...], "factors": {reader node
    name: [k_g, ...]}}}``: ``replay`` (that dict, e.g. from a checkpoint) redoes the same split
    without data. The float function is unchanged up to float32 rounding. ``levels``: (the
    activations' grid steps, the weights' qmax), e.g. (255, 127), for the factors ``k_g``
    (``_factors``); None: ``k_g = R / R_g``."""
    plans = [p for c in list(gm.graph.nodes) if (p := _plan(gm, c)) is not None]
    cats = [c for c in gm.graph.nodes if _mixed_concat(gm, c)] if _cr.CONCATS else []
    if replay is not None:
        plans = [p for p in plans if p.conv.name in replay]
        cats = [c for c in cats if c.name in replay]
        if len(plans) + len(cats) != len(replay):
            raise ValueError(
                f"split_ranges: the recorded split names {sorted(replay)} but this graph "
                f"splits {sorted(p.conv.name for p in plans)} and concatenations "
                f"{sorted(c.name for c in cats)}: a different model"
            )
    elif plans or cats:
        replay = _measure(gm, batches, plans, levels, cats)
    old = set()
    for p in plans:
        if p.conv.name in (replay or {}):
            old |= {n.target for n in p.weights(gm)}
            p.rewrite(gm, replay[p.conv.name])
    for c in cats:
        if c.name in (replay or {}):
            old |= {weight_and_bias(gm, r)[0].target for r in c.users}
            _rescale_concat(gm, c, replay[c.name])
    if old:
        gm.graph.eliminate_dead_code()
        used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
        for target in old - used:  # the split convs' and rescaled readers' old tensors
            owner, attr = _owner(gm, target)
            delattr(owner, attr)
        gm.graph.lint()
        gm.recompile()
    return replay or {}


def _measure(gm, batches, plans, levels, cats=()) -> dict:
    """Per-channel ranges on ``batches`` -> the groups and factors of each plan that pays, and
    the factors of each concatenation (``CONCATS``) where one is not 1."""
    watched = {n for p in plans for n in p.watched()} | {a for c in cats for a in c.args[0]}
    lo: dict = {}
    hi: dict = {}
    power: dict = {}  # per channel: (sum of squares, count)

    def on_value(n, out):
        flat = out.detach().double().transpose(0, 1).reshape(out.shape[1], -1)
        a, b = flat.amin(1), flat.amax(1)
        lo[n] = torch.minimum(lo[n], a) if n in lo else a
        hi[n] = torch.maximum(hi[n], b) if n in hi else b
        sq, count = power.get(n, (0.0, 0))
        power[n] = (sq + flat.pow(2).sum(1), count + flat.shape[1])

    record(gm, batches, watched, on_value)
    found = {}
    for p in plans:
        convs = [p.conv, *p.inner()]
        cut = [*convs, p.out]
        los, his = [lo[c] for c in cut], [hi[c] for c in cut]
        groups = channel_groups(los, his, _sensitivity(gm, p, los, his, lo[p.out], hi[p.out]))
        if len(groups) > 1:
            ends = [*p.depthwise, p.out] if p.mixing else p.depthwise
            factors = {}
            for e in ends:
                readers = list(e.users) if e in p.depthwise else p.mixing
                ms = power[e][0] / power[e][1]
                columns = [_weight(gm, r) for r in readers]
                factors[e.name] = _factors(groups, lo[e], hi[e], ms, columns, levels)
            found[p.conv.name] = {"groups": groups, "factors": factors}
    for c in cats:
        parts = c.args[0]
        sizes = [len(lo[a]) for a in parts]
        groups = _part_groups(sizes)
        lo_c, hi_c = torch.cat([lo[a] for a in parts]), torch.cat([hi[a] for a in parts])
        ms = torch.cat([power[a][0] / power[a][1] for a in parts])
        columns = [_weight(gm, r) for r in c.users]
        k = _factors(groups, lo_c, hi_c, ms, columns, levels)
        if any(kg != 1.0 for kg in k):
            found[c.name] = {"concat": k, "sizes": sizes}
    return found


def _sensitivity(gm, p, los, his, lo_out, hi_out) -> list:
    """Per tensor of the cut, per channel: how much a unit of noise there reaches the readers'
    outputs. At the region's output, the readers' squared weight column norms (a depthwise end:
    its own weight times its readers'); at a tensor before it, that times the channel's range
    ratio (out / here)^2, its gain through the region."""

    def column_power(conv):  # per input channel, the sum of its squared weights
        w = _weight(gm, conv)
        return w.transpose(0, 1).reshape(w.shape[1], -1).pow(2).sum(1)

    s = torch.zeros(len(lo_out), dtype=torch.float64)
    for m in p.mixing:
        s += column_power(m)
    for dw in p.depthwise:
        col = sum((column_power(r) for r in dw.users), torch.zeros_like(s))
        s += _weight(gm, dw).reshape(len(s), -1).pow(2).sum(1) * col
    r_out = (hi_out - lo_out).clamp_min(0)
    out = []
    for a, b in zip(los, his, strict=True):
        r = (b - a).clamp_min(0)
        out.append((s * (r_out / r.clamp_min(r.max() * FLOOR).clamp_min(1e-30)) ** 2).numpy())
    return out


def channel_groups(lo, hi, sensitivity=None) -> list[list[int]]:
    """Channels cut into contiguous groups of the range order (see the module docstring); one
    group (all channels) when no cut lowers the relative noise ``GAIN`` times. ``lo`` / ``hi``
    may be lists (one per tensor the split gives per-group grids: a conv and the depthwise convs
    of its region): the cost is summed over them, the order is that of the channels' geometric
    mean range relative to each tensor's widest."""
    los_t = [x.numpy() for x in (lo if isinstance(lo, (list, tuple)) else [lo])]
    his_t = [x.numpy() for x in (hi if isinstance(hi, (list, tuple)) else [hi])]
    rs = []
    for a, b in zip(los_t, his_t, strict=True):
        r = np.clip(b - a, 0, None)
        rs.append(np.maximum(np.maximum(r, r.max() * FLOOR), 1e-30))
    key = np.sum([np.log(r / r.max()) for r in rs], axis=0)
    order = np.argsort(key, kind="stable")
    n = len(order)
    cost = np.zeros((n + 1, n + 1))  # cost[i, j]: channels order[i:j] as one group
    cost[np.tril_indices(n + 1)] = np.inf
    sens = sensitivity or [1.0 / r**2 for r in rs]
    for a, b, wt in zip(los_t, his_t, sens, strict=True):
        w = wt[order]
        los, his = a[order], b[order]
        for i in range(n):
            mx = np.maximum(np.maximum.accumulate(his[i:]), 0.0)
            mn = np.minimum(np.minimum.accumulate(los[i:]), 0.0)
            cost[i, i + 1 :] += (mx - mn) ** 2 * np.cumsum(w[i:])
    best, cuts = cost[0, n], []
    for g in range(2, min(MAX_GROUPS, n) + 1):
        total, found = _best_cuts(cost, n, g)
        if total * GAIN > best:
            break
        best, cuts = total, found
    bounds = [0, *cuts, n]
    return [sorted(order[a:b].tolist()) for a, b in zip(bounds, bounds[1:], strict=False)]


def _best_cuts(cost: np.ndarray, n: int, g: int) -> tuple[float, list[int]]:
    """(cost, cut points) of the best split of ``[0, n)`` into ``g`` contiguous groups."""
    dp = np.full((g + 1, n + 1), np.inf)
    arg = np.zeros((g + 1, n + 1), dtype=np.int64)
    dp[0, 0] = 0.0
    for k in range(1, g + 1):
        for j in range(k, n + 1):
            v = dp[k - 1, :j] + cost[:j, j]
            arg[k, j] = int(np.argmin(v))
            dp[k, j] = v[arg[k, j]]
    cuts, j = [], n
    for k in range(g, 1, -1):
        j = int(arg[k, j])
        cuts.append(j)
    return float(dp[g, n]), sorted(cuts)


def _is_depthwise(gm, node) -> bool:
    wb = weight_and_bias(gm, node)
    return wb is not None and get_tensor(gm, wb[0]).shape[1] == 1 and groups_of(node) > 1


def _channelwise(gm, node, inside) -> bool:
    """``node`` is a depthwise conv reading the region and read by anything but convs (e.g. its
    own hard-swish): channel ``c`` of its result depends on channel ``c`` of its input only, so
    it is split with the region, each group's copy on its own grid. (A depthwise conv read only
    by convs ends the region instead, its group factor folded into it.)"""
    return (
        THROUGH_DEPTHWISE
        and node.op == "call_function"
        and node.target in CONV_OPS
        and node.args[0] in inside
        and sum(a in inside for a in node.all_input_nodes) == 1
        and _is_depthwise(gm, node)
        and get_tensor(gm, weight_and_bias(gm, node)[0]).shape[0] == groups_of(node)
        and any(u.op != "call_function" or u.target not in CONV_OPS for u in node.users)
    )


def _only_node_args(node, inside) -> bool:
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, torch.fx.Node):
            if a not in inside:
                return False
        elif isinstance(a, (list, tuple, dict)) or (a is not None and not _number(a)):
            return False
    return True


def _number(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


class _Plan:
    """One conv, its element-wise region and the convs at the region's end."""

    def __init__(self, conv, region, out, depthwise, mixing, readers):
        self.conv, self.region, self.out = conv, region, out
        self.depthwise, self.mixing, self.readers = depthwise, mixing, readers

    def inner(self):
        """The depthwise convs inside the region (split with it, no factor)."""
        return [n for n in self.region if n.target in CONV_OPS]

    def weights(self, gm):
        """The get_attr nodes of every conv the rewrite replaces or rescales."""
        convs = [self.conv, *self.inner(), *self.depthwise, *self.readers, *self.mixing]
        return [n for c in convs for n in weight_and_bias(gm, c) if n is not None]

    def watched(self):
        return [self.conv, *self.inner(), self.out, *self.depthwise]

    def rewrite(self, gm, split: dict) -> None:
        g, groups, factors = gm.graph, split["groups"], split["factors"]
        outs = []
        for gi, idx in enumerate(groups):  # the conv and its region, once per group
            with g.inserting_before(self.conv):
                anchor = _conv_copy(gm, self.conv, self.conv.args[0], idx, 1.0, f"g{gi}")
            env = {self.conv: anchor}
            for n in self.region:
                if n.target in CONV_OPS:  # a depthwise conv: its channels ``idx``
                    with g.inserting_before(n):
                        env[n] = anchor = _conv_copy(gm, n, env[n.args[0]], idx, 1.0, f"g{gi}")
                    continue
                with g.inserting_after(anchor):
                    env[n] = anchor = g.node_copy(n, lambda a, env=env: env[a])
            outs.append(env[self.out])
        for dw in self.depthwise:  # split too, factor folded in; its readers read the concat
            k = factors[dw.name]
            with g.inserting_before(dw):
                parts = [
                    _conv_copy(gm, dw, value, idx, kg, f"g{gi}")
                    for gi, (idx, value, kg) in enumerate(zip(groups, outs, k, strict=True))
                ]
                cat = g.call_function(aten.cat.default, (parts, 1))
                cat.meta = dict(dw.meta)
            for r in list(dw.users):
                _scale_columns(gm, r, groups, k)
                r.replace_input_with(dw, cat)
        if self.mixing:  # x_g * k_g concatenated
            k = factors[self.out.name]
            parts = []
            for value, kg in zip(outs, k, strict=True):
                with g.inserting_after(value):
                    parts.append(g.call_function(aten.mul.Tensor, (value, float(kg))))
                parts[-1].meta = dict(value.meta)
            with g.inserting_before(self.mixing[0]):
                cat = g.call_function(aten.cat.default, (parts, 1))
                cat.meta = dict(self.out.meta)
            for r in self.mixing:
                _scale_columns(gm, r, groups, k)
                r.replace_input_with(self.out, cat)


def _conv_copy(gm, conv, inp, idx, k: float, tag: str) -> torch.fx.Node:
    """``conv``'s output channels ``idx`` (times ``k``) as a new conv node reading ``inp``; a
    depthwise ``conv`` keeps one group per channel."""
    t = torch.tensor(idx)
    wb = weight_and_bias(gm, conv)
    w, b = get_tensor(gm, wb[0]), get_tensor(gm, wb[1]) if wb[1] is not None else None
    dims = w.ndim - 2
    stride, padding, dilation = conv_geometry(conv, dims)
    groups = len(idx) if groups_of(conv) > 1 else 1
    w_new = (w.double()[t] * k).to(w.dtype)
    b_new = (b.double()[t] * k).to(b.dtype) if b is not None else None
    wn = _param(gm, f"{wb[0].target}_split{tag}", w_new, wb[0])
    bn = _param(gm, f"{wb[0].target}_split{tag}_bias", b_new, wb[0]) if b is not None else None
    node = gm.graph.call_function(
        conv.target, (inp, wn, bn, list(stride), list(padding), list(dilation), groups)
    )
    node.meta = dict(conv.meta)
    return node


def _plan(gm, conv) -> _Plan | None:
    """The split plan of ``conv``, or None where the graph does not allow one."""
    if conv.op != "call_function" or conv.target not in CONV_OPS or groups_of(conv) != 1:
        return None
    if weight_and_bias(gm, conv) is None:
        return None
    inside = {conv}
    region: list = []
    ends: list = []
    started = False
    for n in gm.graph.nodes:
        if n is conv:
            started = True
            continue
        if not started or not any(a in inside for a in n.all_input_nodes):
            continue
        if n.op == "call_function" and n.target in ELEMENTWISE and _only_node_args(n, inside):
            region.append(n)
            inside.add(n)
        elif _channelwise(gm, n, inside):  # a depthwise conv inside: split per group too
            region.append(n)
            inside.add(n)
        elif (
            n.op == "call_function"
            and n.target in CONV_OPS
            and n.args[0] in inside
            and sum(a in inside for a in n.all_input_nodes) == 1
            and weight_and_bias(gm, n) is not None
        ):
            ends.append(n)
        else:
            return None
    if not region or not ends or len({e.args[0] for e in ends}) != 1:
        return None
    out = ends[0].args[0]
    if any(u not in inside and u not in ends for r in region for u in r.users):
        return None
    if len(conv.users) and any(u not in inside for u in conv.users):
        return None
    depthwise, mixing, readers = [], [], []
    for e in ends:
        if groups_of(e) == 1:
            mixing.append(e)
        elif (
            _is_depthwise(gm, e)
            and e.users
            and all(
                u.op == "call_function"
                and u.target in CONV_OPS
                and groups_of(u) == 1
                and u.args[0] is e
                and weight_and_bias(gm, u) is not None
                for u in e.users
            )
        ):
            depthwise.append(e)
            readers.extend(e.users)
        else:
            return None
    return _Plan(conv, region, out, depthwise, mixing, readers)
