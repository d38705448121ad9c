"""The factors that bring groups of channels to one range where a conv reads them together
(``Recipe.split_ranges``; ``_split_ranges`` uses them at the end of a split region), and the
mixed-range concatenations they also serve.

``k_g`` (``_factors``) balances the readers' two roundings: ``R / R_g`` (``R`` the widest
group's range at the concatenation) gives group ``g`` the whole common grid but divides its
reader columns by ``k_g``, whose rounding (one weight step per reader row, set by the widest
group's columns) then reaches the output ``k_g`` times larger; the modelled output noise of
both is least at ``k_g^4 = A / B`` (clipped to ``[1, R / R_g]``). Without the quantization
``levels`` (a direct call), ``k_g = R / R_g`` as before.

Mixed-range concatenations (``CONCATS``): a channel concatenation read only by channel-mixing
convs (PP-OCRv4 det's neck joins four scales whose ranges differ ~3x into its head) has one grid
in ONNX Runtime; each part ``x_g`` becomes ``x_g * k_g`` with the same ``_factors``, and the
readers take ``W[:, g] / k_g`` (float function unchanged). Recorded in the split's dict under
the concatenation's node name, ``{"concat": [k_g, ...], "sizes": [channels, ...]}``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ._graph import CONV_OPS, get_tensor, groups_of, weight_and_bias

aten = torch.ops.aten
# a channel concatenation read only by channel-mixing convs whose parts differ in range: each
# part x_g becomes x_g * k_g (``_factors``), its readers' columns W[:, g] / k_g, so the common
# grid of the concatenation (ONNX Runtime's Concat keeps one scale) serves the narrow parts too
CONCATS = True


def _weight(gm, conv) -> torch.Tensor:
    return get_tensor(gm, weight_and_bias(gm, conv)[0]).detach().double()


def _factors(groups, lo, hi, ms=None, readers=(), levels=None) -> list[float]:
    """``k_g`` per group at the concatenation its readers read (``x_g * k_g``, read as
    ``W[:, g] / k_g``). ``k_g = R / R_g`` puts group ``g`` on the whole common grid (step
    ``D = R / steps``), but divides the readers' columns of ``g`` by ``k_g``: each reader row's
    weight step ``s_r`` is set by its widest columns (the widest group's, ``k = 1``), so the
    rounding of the columns of ``g`` reaches the output ``k_g`` times larger. Per group, the
    readers' output noise power (per output value, both roundings uniform, the 1/12 dropped):

    .. math:: N_g(k) = \\frac{D^2}{k^2} \\sum_{r, j \\in g, t} W_{rjt}^2
                     + k^2 \\sum_r s_r^2 \\, T \\sum_{j \\in g} E[x_j^2]

    (``t`` the kernel taps, ``T`` their number, ``E[x_j^2]`` channel ``j``'s mean square ``ms``
    before the factor), least at ``k^4 = A / B`` of its two sums, clipped to ``[1, R / R_g]``.
    ``levels`` (activation grid steps, weight qmax) None: ``R / R_g``."""
    ranges = [float(hi[idx].max().clamp_min(0) - lo[idx].min().clamp_max(0)) for idx in groups]
    top = max(ranges)
    full = [top / r if r > 0 else 1.0 for r in ranges]
    if levels is None or not readers:
        return full
    steps, qmax = levels
    widest = groups[ranges.index(top)]
    out = []
    for idx, kmax in zip(groups, full, strict=True):
        if idx is widest:
            out.append(1.0)
            continue
        a = b = 0.0
        for w in readers:  # (out, in, taps...)
            rows = w.reshape(w.shape[0], w.shape[1], -1)
            step = rows[:, widest].abs().amax(dim=(1, 2)) / qmax  # per row, set by k = 1 columns
            a += float(rows[:, idx].pow(2).sum()) * (top / steps) ** 2
            b += float(step.pow(2).sum()) * rows.shape[2] * float(ms[idx].sum())
        k = min(max((a / b) ** 0.25, 1.0), kmax) if b > 0 else kmax
        out.append(float(k))
    return out


def _mixed_concat(gm, node) -> bool:
    """A channel concatenation of graph values read only by channel-mixing convs (groups =
    1): its parts can be brought to one range (``_rescale_concat``)."""
    if node.op != "call_function" or node.target is not aten.cat.default:
        return False
    if len(node.args) < 2 or node.args[1] != 1 or len(node.args[0]) < 2:
        return False
    if not all(isinstance(a, torch.fx.Node) for a in node.args[0]) or not node.users:
        return False
    return all(
        u.op == "call_function"
        and u.target in CONV_OPS
        and groups_of(u) == 1
        and u.args[0] is node
        and sum(a is node for a in u.all_input_nodes) == 1
        and weight_and_bias(gm, u) is not None
        for u in node.users
    )


def _rescale_concat(gm, cat, split: dict) -> None:
    """Part ``g`` of ``cat`` becomes ``x_g * k_g``; its readers take ``W[:, g] / k_g``."""
    k, sizes = split["concat"], split["sizes"]
    parts = []
    for a, kg in zip(cat.args[0], k, strict=True):
        if kg == 1.0:  # the widest part
            parts.append(a)
            continue
        with gm.graph.inserting_before(cat):
            m = gm.graph.call_function(aten.mul.Tensor, (a, float(kg)))
        m.meta = dict(a.meta)
        parts.append(m)
    cat.args = (parts, *cat.args[1:])
    groups = _part_groups(sizes)
    for r in list(cat.users):
        _scale_columns(gm, r, groups, k)


def _part_groups(sizes: list[int]) -> list[list[int]]:
    """The channels of each part of a concatenation of parts with ``sizes`` channels."""
    starts = np.cumsum([0, *sizes])
    return [list(range(a, b)) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _scale_columns(gm, reader, groups, k) -> None:
    """``reader`` (a groups = 1 conv) reads the concatenation: input column ``j`` is channel
    ``perm[j]`` times ``k`` of its group, so the weight becomes ``W[:, perm] / k``."""
    wn, _ = weight_and_bias(gm, reader)
    w = get_tensor(gm, wn)
    perm = torch.tensor([c for idx in groups for c in idx])
    kk = torch.tensor(
        [kg for idx, kg in zip(groups, k, strict=True) for _ in idx], dtype=torch.float64
    )
    shape = [1, -1] + [1] * (w.ndim - 2)
    new = (w.double()[:, perm] / kk.reshape(shape)).to(w.dtype)
    with gm.graph.inserting_before(reader):
        node = _param(gm, f"{wn.target}_cat", new, wn)
    reader.replace_input_with(wn, node)


def _param(gm, name: str, value: torch.Tensor, like) -> torch.fx.Node:
    base = name.replace(".", "_")
    i = 0
    while hasattr(gm, f"{base}_{i}"):
        i += 1
    gm.register_parameter(f"{base}_{i}", nn.Parameter(value.detach().clone(), requires_grad=False))
    node = gm.graph.get_attr(f"{base}_{i}")
    node.meta = dict(like.meta)
    return node
