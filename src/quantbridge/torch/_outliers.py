"""Residual adds whose outputs carry outlier channels: left float (``Recipe.float_outlier_residuals``).

Transformers trained at scale (BERT, RoBERTa, GPT-2, ...) grow a few hidden channels whose values
are two orders of magnitude above the rest (MiniLM-L6: up to ~230 against a typical 1-3; Bondarenko
et al. 2021, Dettmers et al. 2022). They live in the residual stream: the sum ``x + f(x)`` that a
LayerNorm then normalises. One per-tensor uint8 scale on that sum is set by the outliers, so the
ordinary channels keep a handful of levels, and the LayerNorm after it spreads their error over
every feature. SmoothQuant (``Recipe.smoothquant``) moves outliers out of the *inputs* of linear
layers into their weights; it cannot help a tensor that no linear reads first.

``outlier_residuals`` runs the float captured graph on one batch (the first calibration batch) and
returns the user modules that own an add of two computed tensors whose result is read by a layer
norm and whose per-channel (last dimension) absolute maximum has a largest / median ratio of at
least ``OUTLIER_RATIO`` - 16: with 8 bits the median channel would keep 256 / 16 = 16 levels or
fewer. ``prepare`` turns them into skip rules (``Rule(pattern=<module>, skip=True)``) recorded in
the model's recipe, so a saved model replays the same decision; the add then runs in float, and a
linear whose only reader is that add keeps a float output (``_placement._read_by_skipped_only``).
Every linear still has int8 inputs and weights.

Measured on MiniLM-L6 (``tests/test_minilm_smoothquant.py``, 16 calibration sentences of 64
tokens): the six feed-forward residual adds (``bert.encoder.layer.N.output``) have ratios 25-118,
the six attention ones (``layer.N.attention.output``) 4.4-6.3; the rule picks exactly the modules
that the hand-written rule of ``examples/minilm.py`` names.
"""

from __future__ import annotations

import glob

import torch
from torch.utils._pytree import tree_flatten

from ..recipe import Rule
from ._nodes import constant_values, module_of

OUTLIER_RATIO = 16.0
aten = torch.ops.aten
ADD_OPS = frozenset({aten.add.Tensor})
NORM_OPS = frozenset(
    {aten.layer_norm.default, aten.native_layer_norm.default}
    | ({aten.rms_norm.default} if hasattr(aten, "rms_norm") else set())
)
# ops between the add and its norm that keep the values (dropout is the identity in eval)
PASS_THROUGH = frozenset({aten.dropout.default, aten.clone.default, aten.alias.default})


def _read_by_norm(node: torch.fx.Node) -> bool:
    for user in node.users:
        if user.op != "call_function":
            continue
        if user.target in NORM_OPS and user.args and user.args[0] is node:
            return True
        if user.target in PASS_THROUGH and _read_by_norm(user):
            return True
    return False


def channel_ratio(value: torch.Tensor) -> float:
    """Largest / median per-channel absolute maximum, channels on the last dimension."""
    if value.ndim < 2 or value.shape[-1] < 2:
        return 0.0
    return peak_ratio(value.detach().abs().reshape(-1, value.shape[-1]).amax(0).double())


def peak_ratio(peaks: torch.Tensor) -> float:
    """Largest / median of per-channel absolute maxima ``peaks`` (inf when the median is 0)."""
    median = float(peaks.median())
    return float(peaks.max()) / median if median > 0 else float("inf")


def outlier_residuals(
    gm: torch.fx.GraphModule, args: tuple, kwargs: dict, ratio: float = OUTLIER_RATIO
) -> dict[str, float]:
    """Module name -> outlier ratio, for each module owning a residual add (two computed float
    inputs, read by a layer norm) whose output's channel ratio is ``ratio`` or more."""
    constant = constant_values(gm.graph)
    adds = {
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.target in ADD_OPS
        and sum(isinstance(a, torch.fx.Node) and a not in constant for a in n.args[:2]) == 2
        and _read_by_norm(n)
    }
    if not adds:
        return {}
    ratios: dict[torch.fx.Node, float] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node):
            out = super().run_node(n)
            if n in adds and isinstance(out, torch.Tensor) and out.is_floating_point():
                ratios[n] = channel_ratio(out)
            return out

    with torch.no_grad():
        _Recorder(gm).run(*tree_flatten((args, kwargs))[0])
    found: dict[str, float] = {}
    for n, r in ratios.items():
        module = module_of(n)[0]
        if r >= ratio and module:
            found[module] = max(r, found.get(module, 0.0))
    return found


def outlier_rules(found: dict[str, float]) -> tuple[Rule, ...]:
    """Skip rules for the modules ``outlier_residuals`` found (names escaped for the glob)."""
    return tuple(Rule(pattern=glob.escape(m), skip=True) for m in sorted(found))
