"""SmoothQuant-style outlier migration into linears (Xiao et al. 2023, "SmoothQuant").

A few input channels of a transformer's linears carry values 100x the rest (BERT's feed-forward
outputs: up to ~230 against a typical 1): one per-tensor activation scale then leaves the other
channels a handful of levels. Dividing input channel ``j`` by ``s_j`` and multiplying column ``j``
of every weight that reads it by ``s_j`` leaves ``x W^T`` unchanged and moves the range into the
weights, which are quantized per output channel:

.. math::
   s_j = \\max|X_j|^{\\alpha} / \\max|W_{\\cdot j}|^{1-\\alpha},\\qquad
   x W^T = (x\\,\\mathrm{diag}(s)^{-1})\\,(W\\,\\mathrm{diag}(s))^T

``alpha``: ``Recipe.smoothquant`` as a number, or ``"auto"``: per group, the alpha of
``ALPHAS`` (or no smoothing at all) whose quantized output ``Q(x / s) Q(W s)^T`` is closest (squared
error) to the float ``x W^T`` on up to ``MAX_ROWS`` calibration rows; activation range: the
min / max of ``x / s`` over all the calibration data, grids from the recipe's schemes (the search
uses minmax for activations whatever the recipe's calibration method). A group is every
quantized linear reading the same tensor (Q, K and V share ``s``).

Where ``1 / s`` goes (``Case`` labels in ``_apply``):

1. the tensor is a LayerNorm's output read only by the group: into its affine weight and bias;
2. it is a linear's output read only by the group: into that linear's rows and bias;
3. otherwise (a LayerNorm output that also feeds a residual add, a GELU output): an explicit
   ``x / s`` (``aten.div``, a float op placement leaves unquantized: its output is quantized by
   the linears' input quantizer) with ``s`` a buffer of the model, exported as an ONNX ``Div``.

``Recipe.smoothquant_scope="transformer"`` smooths only transformer-shaped graphs, those where a
LayerNorm feeds a linear, and in them only the linear inputs whose channels hold outliers on the
calibration data: largest / median per-channel absolute maximum at least
``_outliers.OUTLIER_RATIO`` (16, the measure and bound of ``float_outlier_residuals``). A graph
without LayerNorm (a CNN) is left as it was at no cost (no pass over the data); a transformer
without outlier channels likewise. Measured (MiniLM-L6, torch, 48 calibration / 222 held-out
sentences, the ``default`` preset plus ``float_outlier_residuals``, 2026-12-01): it smooths 5 of
24 inputs (the first GELU output, four LayerNorm outputs): mean cosine 0.9909 without bias
correction, 0.9899 with it (a prototype gated to LayerNorm outputs only: 0.9891 with it). Scope
"all" smooths 23 of 24 there; the ``transformer`` preset (scope "all", native weights, no bias
correction) reaches 0.9931. Random-weight transformers (``zoo.EncoderBlock``) have no outlier
channel: scope "transformer" leaves them as they were, where smoothing every LayerNorm output
cost 0.28 dB of output SQNR (``python -m bench.transformer_rows --tiny``). Not in the ``default``
preset (yet): with ``float_outlier_residuals`` it takes MiniLM from 0.855 to 0.9913 in ONNX
Runtime (bench quick, 64 sentences, a LayerNorm-outputs-only prototype) but 0.9899 on 222 in
torch with the default's bias correction - at the 0.99 bar, not above it - and a model it acts
on gets float Div / Add ops that ``qb.lower`` refuses (``python -m bench.transformer_rows``).

Cases 1-2 change only weights; case 3 changes the graph, so the names of the divided tensors are
recorded (``QuantModel.qb_capture["smoothed"]``) and ``load`` inserts the same divisions.
"""

from __future__ import annotations

import numpy as np
import torch

from ...numerics import PerChannel, choose_qparams, fake_quantize
from ...recipe import Recipe, TensorRecipe
from .._nodes import module_of
from .._outliers import OUTLIER_RATIO, peak_ratio
from ._graph import attr_node, get_tensor, record, set_tensor, weight_and_bias

aten = torch.ops.aten
ALPHAS = tuple(float(a) for a in np.round(np.linspace(0.0, 1.0, 11), 2))
# rows (tokens) of each input kept for the search, float32: the error is a mean, and 512 rows
# pick the same alphas on MiniLM as 2048 in float64 at a tenth of the time
MAX_ROWS = 512
MIN_SCALE = 1e-5  # s below this would blow a weight column up past what float32 keeps exact
LAYER_NORM_OPS = frozenset({aten.layer_norm.default})


def _groups(gm, recipe: Recipe) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Input tensor -> the quantized linears that read it (weight a parameter, not skipped)."""
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        if weight_and_bias(gm, node) is None or not isinstance(node.args[0], torch.fx.Node):
            continue
        if recipe.for_module(*module_of(node))[0]:
            continue
        groups.setdefault(node.args[0], []).append(node)
    if recipe.smoothquant_scope == "transformer" and not any(map(_is_layer_norm, groups)):
        return {}  # not transformer-shaped: no LayerNorm feeds a linear
    return groups


def _is_layer_norm(x: torch.fx.Node) -> bool:
    return x.op == "call_function" and x.target in LAYER_NORM_OPS


class _Stats:
    """Per input channel min / max over all calls (float64), and up to ``MAX_ROWS`` rows."""

    def __init__(self, calls: int):
        self.lo = self.hi = None
        self.rows: list[torch.Tensor] = []
        self.per_call = max(1, MAX_ROWS // max(calls, 1))

    def update(self, _node, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, x.shape[-1])
        lo, hi = rows.amin(0).double(), rows.amax(0).double()
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)
        step = max(1, rows.shape[0] // self.per_call)
        self.rows.append(rows[::step][: self.per_call].float())

    def outlier_ratio(self) -> float:
        """Largest / median per-channel absolute maximum (``_outliers.channel_ratio``'s measure,
        over all calibration calls)."""
        return peak_ratio(torch.maximum(self.hi.abs(), self.lo.abs()))


def _fake_quantize(x: torch.Tensor, lo, hi, tr: TensorRecipe, axis: int | None) -> torch.Tensor:
    scheme = tr.scheme
    scale, zero_point = choose_qparams(np.asarray(lo), np.asarray(hi), scheme)
    scale = torch.as_tensor(scale, dtype=x.dtype)
    return fake_quantize(x, scale, torch.as_tensor(zero_point), scheme.qmin, scheme.qmax, axis)


class _Group:
    """One group's search: its rows, float weights, schemes and float outputs."""

    def __init__(self, stats: _Stats, weights: list[torch.Tensor], recipes: list):
        self.stats, self.weights, self.recipes = stats, weights, recipes
        self.x = torch.cat(stats.rows)
        self.refs = [self.x @ w.float().T for w in weights]

    def error(self, s: torch.Tensor) -> float:
        """Squared error of ``Q(x / s) Q(W s)^T`` against ``x W^T``, summed over the group."""
        lo, hi = float((self.stats.lo / s).min()), float((self.stats.hi / s).max())
        xq = _fake_quantize(self.x / s.float(), lo, hi, self.recipes[0][1], None)
        err = 0.0
        for w, ref, (wr, _) in zip(self.weights, self.refs, self.recipes, strict=True):
            ws = w * s
            if isinstance(wr.scheme.granularity, PerChannel):
                wq = _fake_quantize(ws, ws.amin(1).numpy(), ws.amax(1).numpy(), wr, 0)
            else:
                wq = _fake_quantize(ws, float(ws.min()), float(ws.max()), wr, None)
            err += float((xq @ wq.float().T - ref).double().pow(2).sum())
        return err

    def scales(self, alpha: float) -> torch.Tensor:
        x_max = torch.maximum(self.stats.hi.abs(), self.stats.lo.abs())
        w_max = torch.cat([w.abs() for w in self.weights]).amax(0)
        s = x_max.pow(alpha) / w_max.pow(1.0 - alpha)
        usable = (x_max > 0) & (w_max > 0) & torch.isfinite(s)
        return torch.where(usable, s.clamp_min(MIN_SCALE), torch.ones_like(s))

    def choose(self, alpha) -> tuple[torch.Tensor | None, float | None]:
        """(s, alpha); s None when no smoothing is best."""
        if alpha != "auto":
            return self.scales(float(alpha)), float(alpha)
        best = (self.error(torch.ones_like(self.stats.hi)), None, None)
        for a in ALPHAS:
            s = self.scales(float(a))
            e = self.error(s)
            if e < best[0]:
                best = (e, s, float(a))
        return best[1], best[2]


def _divide(gm: torch.fx.GraphModule, x: torch.fx.Node, group, s: torch.Tensor) -> None:
    """Case 3: ``x / s`` in front of the group, ``s`` a buffer named after ``x``."""
    name = f"qb_smooth_{x.name}"
    gm.register_buffer(name, s.to(torch.float32))
    with gm.graph.inserting_after(x):
        buf = gm.graph.get_attr(name)
    with gm.graph.inserting_after(buf):
        div = gm.graph.call_function(aten.div.Tensor, (x, buf))
    if "nn_module_stack" in group[0].meta:  # debug tools name it after the first linear
        div.meta["nn_module_stack"] = group[0].meta["nn_module_stack"]
    if "val" in x.meta:
        div.meta["val"] = x.meta["val"]
    for linear in group:
        linear.args = (div, *linear.args[1:])


def _apply(gm, x: torch.fx.Node, group, s: torch.Tensor) -> bool:
    """Put ``1 / s`` on the input side; True when a division was inserted (case 3)."""
    for linear in group:
        w_node = weight_and_bias(gm, linear)[0]
        set_tensor(gm, w_node, get_tensor(gm, w_node).double() * s)
    only_group = set(x.users) == set(group)
    if only_group and _is_layer_norm(x):
        ln_w = attr_node(x.args[2]) if len(x.args) > 2 and x.args[2] is not None else None
        ln_b = attr_node(x.args[3]) if len(x.args) > 3 and x.args[3] is not None else None
        if ln_w is not None and ln_b is not None:  # Case 1
            set_tensor(gm, ln_w, get_tensor(gm, ln_w).double() / s)
            set_tensor(gm, ln_b, get_tensor(gm, ln_b).double() / s)
            return False
    wb = weight_and_bias(gm, x) if only_group and x.target is aten.linear.default else None
    if wb is not None:  # Case 2
        w_node, b_node = wb
        set_tensor(gm, w_node, get_tensor(gm, w_node).double() / s.reshape(-1, 1))
        if b_node is not None:
            set_tensor(gm, b_node, get_tensor(gm, b_node).double() / s)
        return False
    _divide(gm, x, group, s)  # Case 3
    return True


def smooth(gm: torch.fx.GraphModule, recipe: Recipe, batches) -> tuple[list[str], dict]:
    """Smooth every group of ``gm`` in place (the float function is unchanged up to float32
    rounding). Returns the names of the tensors that got an explicit division (what ``replay``
    needs) and ``{input tensor name: alpha}`` of every group (None: left as it was)."""
    groups = _groups(gm, recipe)
    if not groups:  # nothing to smooth (e.g. scope "transformer" on a graph without LayerNorm)
        return [], {}
    stats = {x: _Stats(len(batches)) for x in groups}
    record(gm, batches, set(groups), lambda n, v: stats[n].update(n, v))
    divided, chosen = [], {}
    for x, group in groups.items():
        if x not in stats or stats[x].lo is None:
            continue
        if recipe.smoothquant_scope == "transformer":
            if stats[x].outlier_ratio() < OUTLIER_RATIO:
                chosen[x.name] = None  # no outlier channel: left as it was
                continue
        weights = [get_tensor(gm, weight_and_bias(gm, n)[0]).detach().double() for n in group]
        recipes = [recipe.for_module(*module_of(n))[1:] for n in group]
        s, alpha = _Group(stats[x], weights, recipes).choose(recipe.smoothquant)
        chosen[x.name] = alpha
        if s is not None and _apply(gm, x, group, s):
            divided.append(x.name)
    if divided:
        gm.graph.lint()
        gm.recompile()
    return sorted(divided), chosen


def replay(gm: torch.fx.GraphModule, recipe: Recipe, names: list[str]) -> None:
    """Insert the divisions of an earlier ``smooth`` (scales 1 until a state dict fills them)."""
    groups = {x.name: (x, g) for x, g in _groups(gm, recipe).items()}
    for name in names:
        if name not in groups:
            raise ValueError(
                f"smoothquant: the saved model divides tensor {name!r}, which the captured graph "
                f"has no quantized linear input named so; known: {sorted(groups)}"
            )
        x, group = groups[name]
        columns = get_tensor(gm, weight_and_bias(gm, group[0])[0]).shape[1]
        _divide(gm, x, group, torch.ones(columns))
    if names:
        gm.graph.lint()
        gm.recompile()
