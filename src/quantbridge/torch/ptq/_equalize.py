"""Cross-layer equalization with high-bias absorption (Nagel et al. 2019, "Data-Free Quantization
Through Weight Equalization and Bias Correction").

Pairs: a conv / linear ``layer1`` whose output feeds only ``layer2`` (a conv / linear), directly
or through one ReLU. ReLU is positively homogeneous, ``relu(x / s) = relu(x) / s`` for ``s > 0``,
so scaling output channel ``i`` of ``layer1`` by ``1 / s_i`` and input channel ``i`` of
``layer2`` by ``s_i`` leaves the float function unchanged:

.. math::
   r^{(1)}_i = \\max |W^{(1)}_{i,\\cdot}|,\\quad r^{(2)}_i = \\max |W^{(2)}_{\\cdot,i}|,\\quad
   s_i = \\sqrt{r^{(1)}_i / r^{(2)}_i},\\quad
   W^{(1)}_{i} \\leftarrow W^{(1)}_{i} / s_i,\\ b^{(1)}_i \\leftarrow b^{(1)}_i / s_i,\\quad
   W^{(2)}_{\\cdot,i} \\leftarrow W^{(2)}_{\\cdot,i}\\, s_i

after which both ranges of channel ``i`` equal ``sqrt(r1_i r2_i)``: a per-tensor weight grid no
longer wastes its levels on the one channel with the largest range. Chains (conv -> relu -> dw
conv -> relu -> conv) are equalized pair by pair, repeated ``ROUNDS`` times (each round brings
the chain closer to the fixed point; Nagel et al. iterate the same way). ReLU6 / hardtanh clip at
a fixed value and do not commute with scaling: pairs through them are left alone.

High-bias absorption: equalization can grow ``b1`` (channels with ``s_i < 1``). Where the
pre-activation ``y_i = (W1 x + b1)_i`` stays ``>= c_i > 0``, ``relu(y) = relu(y - c) + c``, so
``c`` moves out of ``b1`` into ``b2 += W2 c`` (summed over the kernel). Nagel et al. take
``c = max(0, beta - 3 gamma)`` from batch-norm statistics, which the captured graph has folded
away; here ``c = max(0, min(mean - 3 std, min y))`` of ``y`` over the example batch. Exact for
every input whose pre-activations stay above ``c`` (all of the example batch); an input below it
in some channel gets ``c - y`` added there after the ReLU (the 3-sigma margin makes that rare
and small; measured in ``tests/torch/test_ptq_equalize.py``). Done only where ``layer2`` has no
zero padding (a padded border would miss the constant), i.e. linears and unpadded convs.

Grouped convs: input channel ``i`` of ``layer2`` with ``g`` groups is column ``i mod (in / g)`` of
the output channels of group ``i // (in / g)``; depthwise convs (``g = in``) are the common case.
"""

from __future__ import annotations

import torch

from ._graph import CONV_OPS, get_tensor, groups_of, record, set_tensor, weight_and_bias

aten = torch.ops.aten
ROUNDS = 8  # a chain of depth 3 (conv/dw/conv) changes its scales by < 1e-3 after ~6 rounds
RELU_OPS = frozenset({aten.relu.default, aten.relu_.default})


def find_pairs(
    gm: torch.fx.GraphModule,
) -> list[tuple[torch.fx.Node, torch.fx.Node | None, torch.fx.Node]]:
    """(layer1, relu or None, layer2) for every equalizable pair, in graph order."""
    pairs = []
    for node in gm.graph.nodes:
        wb2 = weight_and_bias(gm, node)
        if wb2 is None:
            continue
        act = node.args[0]
        relu = None
        if isinstance(act, torch.fx.Node) and act.op == "call_function" and act.target in RELU_OPS:
            relu, act = act, act.args[0]
            if len(relu.users) != 1:
                continue
        if not isinstance(act, torch.fx.Node) or len(act.users) != 1:
            continue
        if weight_and_bias(gm, act) is None:
            continue
        pairs.append((act, relu, node))
    return pairs


def _in_channel_view(w2: torch.Tensor, groups: int) -> torch.Tensor:
    """``w2`` as (groups, out / groups, in / groups, rest): input channels on axes 0 and 2."""
    out = w2.shape[0]
    return w2.reshape(groups, out // groups, w2.shape[1], -1)


def _in_ranges(w2: torch.Tensor, groups: int) -> torch.Tensor:
    return _in_channel_view(w2, groups).abs().amax(dim=(1, 3)).reshape(-1)


def _scale_in(w2: torch.Tensor, groups: int, s: torch.Tensor) -> torch.Tensor:
    view = _in_channel_view(w2, groups)
    return (view * s.reshape(groups, 1, -1, 1)).reshape(w2.shape)


def _row(t: torch.Tensor) -> list[int]:
    return [-1] + [1] * (t.ndim - 1)


def equalize_pair(gm, layer1, layer2) -> bool:
    """One equalization step of a pair; False when channel counts do not line up."""
    (w1n, b1n), (w2n, _) = weight_and_bias(gm, layer1), weight_and_bias(gm, layer2)
    w1, w2 = get_tensor(gm, w1n).double(), get_tensor(gm, w2n).double()
    groups = groups_of(layer2)
    if w2.shape[1] * groups != w1.shape[0]:
        return False
    r1 = w1.reshape(w1.shape[0], -1).abs().amax(dim=1)
    r2 = _in_ranges(w2, groups)
    ok = (r1 > 0) & (r2 > 0)
    s = torch.where(ok, torch.sqrt(r1 / r2.clamp_min(1e-300)), torch.ones_like(r1))
    set_tensor(gm, w1n, w1 / s.reshape(_row(w1)))
    if b1n is not None:
        set_tensor(gm, b1n, get_tensor(gm, b1n).double() / s)
    set_tensor(gm, w2n, _scale_in(w2, groups, s))
    return True


def _padded(node) -> bool:
    if node.target not in CONV_OPS:
        return False
    padding = node.args[4] if len(node.args) > 4 else node.kwargs.get("padding", 0)
    if isinstance(padding, str):
        return padding != "valid"
    return any(int(p) != 0 for p in (padding if isinstance(padding, (list, tuple)) else [padding]))


def absorb_high_bias(gm, pairs, batches) -> int:
    """Move each always-positive part of ``b1`` through the ReLU into ``b2``; returns how many
    pairs changed. ``batches``: (args, kwargs) calls of the captured graph."""
    eligible = [
        (l1, l2)
        for l1, relu, l2 in pairs
        if relu is not None
        and weight_and_bias(gm, l1)[1] is not None
        and not _padded(l2)
        and weight_and_bias(gm, l2)[1] is not None
    ]
    if not eligible:
        return 0
    stats: dict[torch.fx.Node, list[torch.Tensor]] = {}  # count, sum, sum of squares, min

    def on_value(n, out):
        axis = 1 if n.target in CONV_OPS else out.ndim - 1
        y = out.double().movedim(axis, -1).reshape(-1, out.shape[axis])
        new = [torch.tensor(float(y.shape[0])), y.sum(0), y.pow(2).sum(0), y.amin(0)]
        old = stats.get(n)
        stats[n] = (
            new
            if old is None
            else [
                *(a + b for a, b in zip(old[:3], new[:3], strict=True)),
                torch.minimum(old[3], new[3]),
            ]
        )

    record(gm, batches, {l1 for l1, _ in eligible}, on_value)
    changed = 0
    for l1, l2 in eligible:
        (_, b1n), (w2n, b2n) = weight_and_bias(gm, l1), weight_and_bias(gm, l2)
        b1 = get_tensor(gm, b1n).double()
        count, total, squares, low = stats[l1]
        mean = total / count
        std = (squares / count - mean.pow(2)).clamp_min(0.0).sqrt()
        c = torch.clamp(torch.minimum(torch.minimum(mean - 3 * std, low), b1), min=0.0)
        if not bool((c > 0).any()):
            continue
        w2 = get_tensor(gm, w2n).double()
        groups = groups_of(l2)
        view = _in_channel_view(w2, groups)  # (g, out/g, in/g, rest)
        cg = c.reshape(groups, 1, -1, 1)
        shift = (view * cg).sum(dim=(2, 3)).reshape(-1)
        set_tensor(gm, b1n, b1 - c)
        set_tensor(gm, b2n, get_tensor(gm, b2n).double() + shift)
        changed += 1
    return changed


def equalize(gm: torch.fx.GraphModule, batches=(), rounds: int = ROUNDS) -> int:
    """Equalize every pair of ``gm`` in place (then absorb high biases measured on ``batches``);
    returns the number of pairs. The float function is unchanged up to float32 rounding."""
    pairs = find_pairs(gm)
    done = set()
    for _ in range(rounds):
        for l1, _, l2 in pairs:
            if equalize_pair(gm, l1, l2):
                done.add((l1, l2))
    if batches:
        absorb_high_bias(gm, [p for p in pairs if (p[0], p[2]) in done], batches)
    return len(done)
