"""``compare``'s credit through a normalization: ``LayerNormalization`` (also written out),
``Softmax``, and attention's ``Softmax(q @ k) @ v`` (the error their output can carry from their
inputs' differences).

Both ops mix a row of elements, and both can amplify: a layer norm divides by the row's standard
deviation (a 1-step difference on a row of small spread is many steps after it), a softmax
multiplies by its probabilities. The bounds below are exact in real arithmetic, element by
element, from the reference's input values ``x`` and the pair's input differences ``D >= |d|``
(``d = x' - x``, the other engine's input minus the reference's); the engines' own float32
rounding of the op is left to ``classify``'s one step.

**LayerNormalization** over the axes from ``axis`` on (``N`` elements a row), ``mu``, ``var`` the
row's mean and (biased) variance, ``sigma = sqrt(var + eps)``, ``z = (x - mu) / sigma``,
``y = gamma * z + beta``. With ``P`` the centering (``Px = x - mu``):

    z' - z = P(x + d) / sigma' - Px / sigma = (Pd + z (sigma - sigma')) / sigma'

exactly (``Px = z sigma``). ``sqrt(var) = |Px| / sqrt N`` is a seminorm, so
``|sqrt(var') - sqrt(var)| <= |Pd| / sqrt N <= rms(d) <= rms(D) =: r``, and
``a -> sqrt(a^2 + eps)`` is 1-Lipschitz, so ``|sigma' - sigma| <= r`` and ``sigma' >= sigma - r``.
With ``|(Pd)_i| = |d_i - mean d| <= D_i + mean D``:

    |y'_i - y_i| <= |gamma_i| (D_i + mean(D) + |z_i| r) / (sigma - r)        (sigma > r)

A row where ``sigma <= r`` (the difference as large as the row's spread) gets no credit (0: an
error there still shows as a divergence). For one element off by one step ``D = e_j s``, the
bound is about ``|gamma| s / sigma``, the layer norm's true gain. ``beta`` carries nothing.

**Softmax** along ``axis``: ``p_i = exp(x_i) / sum_j exp(x_j)``. Then
``p'_i / p_i = exp(d_i) / sum_j p_j exp(d_j)``, and the denominator, a mean of ``exp(d_j)`` with
weights ``p``, lies in ``[exp(-max D), exp(max D)]`` (``max`` over the row), so

    |p'_i - p_i| <= p_i (exp(D_i + max D) - 1)

(``p_i`` the reference's probability, computed here in float64 from ``x``). Elements of
``-inf`` (a mask: the same in both engines, ``D = 0``) have ``p_i = 0`` and carry nothing.

The layer norm of opsets < 17 written out (``Div(Sub(x, ReduceMean(x)), Sqrt(Add(ReduceMean(
Pow(Sub, 2)), eps)))``, any axes) is the same op with ``gamma = 1``; where ``var + eps`` is
itself a quantized tensor ``v`` (ONNX Runtime's quantize_static), ``(x - mean x) / sqrt(v)`` of
two sites gets ``quotient_bound``.

Attention whose scores and probabilities stay in float, ``MatMul(Softmax(c * MatMul(q, k)),
v)`` of three sites, composes the exact bounds of its steps (``attention_bound``): a product's
for the scores, the softmax's for the probabilities, a product's for ``P @ v``. Where the
scores are a quantized tensor and masked before the softmax by a mask computed from graph inputs
(BERT's, GPT-2's attention mask, causal mask; torch's safe-softmax ``Where(IsNaN(p), 0, p)``
after it), ``masked_attention_bound`` bounds ``P @ v`` without the mask, from the fact that
the probabilities of a row sum to 1 (or are all 0) in both engines.

Ops that only move or select elements (``_gain.SELECTING_OPS``: GPT-2's ``LN -> view``) may
stand between the op and its QuantizeLinear, and Pad and max pooling (1-Lipschitz in the
largest element): the bound is computed on the op's output and its largest element bounds every
element they pick.

``tests/debug/test_compare_norm_credit.py`` checks every bound against float64 recomputations
of random rows and perturbations (hypothesis).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ._gain import SELECTING_OPS

# ops after the normalization that keep its largest-element bound: data movement, Pad (copies
# or a constant; timm Swin's LN -> window pad -> view -> Q) and max pooling
# (|max a - max b| <= max |a - b| over the window; timm NesT's LN -> MaxPool -> Q)
_MOVES = SELECTING_OPS | {"Pad", "MaxPool", "GlobalMaxPool"}


def norm_of(node: onnx.NodeProto, producer: dict, operand, opset: int) -> dict:
    """For a QuantizeLinear ``node`` reading ``LayerNormalization(x, gamma[, beta])`` or
    ``Softmax(x)`` (through data movement) of one site ``x`` (read through its
    DequantizeLinear; ``gamma`` constant), or the written-out forms and attention of the module
    docstring: ``{"factors": (sites...), "norm": {"op": ...}}`` for ``compare._carried``; else
    ``{}``. ``operand`` as ``_gain.linear_weight``'s."""
    if node.op_type != "QuantizeLinear":
        return {}
    return norm_at(node.input[0], producer, operand, opset)


def norm_at(tensor: str, producer: dict, operand, opset: int) -> dict:
    """``norm_of`` for the float tensor ``tensor`` (a QuantizeLinear's input, or a float graph
    output: a final layer norm)."""
    p = producer.get(tensor)
    for _ in range(8):  # data movement after the op (GPT-2's LN -> view -> Conv1D's Q)
        if p is None or p.op_type not in _MOVES:
            break
        p = producer.get(p.input[0])
    if p is not None and p.op_type == "Div":
        return _decomposed(p, producer, operand) or _l2_ratio(p, producer, operand)
    if p is not None and p.op_type == "MatMul":
        return _attention(p, producer, operand, opset)
    if p is None or p.op_type not in ("LayerNormalization", "Softmax"):
        return {}
    if p.domain not in ("", "ai.onnx"):
        return {}
    x, pre = _pooled(p.input[0], producer, operand)
    if not isinstance(x, str):
        return {}
    attrs = {a.name: helper.get_attribute_value(a) for a in p.attribute}
    if p.op_type == "Softmax":
        if opset < 13:  # axis coerced the input to 2-D before opset 13
            return {}
        norm = {"op": "Softmax", "axis": int(attrs.get("axis", -1)), "pre": pre}
        return {"factors": (x,), "norm": norm}
    gamma = operand(p.input[1]) if len(p.input) > 1 else None
    if not isinstance(gamma, np.ndarray):
        return {}
    return {
        "factors": (x,),
        "norm": {
            "op": "LayerNormalization",
            "axis": int(attrs.get("axis", -1)),
            "epsilon": float(attrs.get("epsilon", 1e-5)),
            "gamma": np.abs(gamma.astype(np.float64)),
            "pre": pre,
        },
    }


def _pooled(t: str, producer: dict, operand) -> tuple:
    """``(site, pre)``: ``t`` a site, or a Transpose / ReduceMean (keepdims) of one (timm's
    head: ``LN(permute(x.mean((2, 3))))``); ``pre`` those ops, the innermost first. The pooled
    difference is at most the mean of ``|dx|`` (``|mean dx| <= mean |dx|``), so the norm's
    bound holds with ``x`` and ``D`` pooled and moved alike (``norm_bound``)."""
    pre: list = []
    for _ in range(8):
        if isinstance(operand(t), str):
            break
        q = producer.get(t)
        if q is not None and q.op_type == "Transpose":
            perm = next((list(a.ints) for a in q.attribute if a.name == "perm"), None)
            pre.append(("Transpose", perm))
        elif q is not None and q.op_type == "ReduceMean" and _kept_axes(q, operand):
            pre.append(("ReduceMean", _kept_axes(q, operand)))
        else:
            return None, ()
        t = q.input[0]
    return operand(t), tuple(reversed(pre))


def _decomposed(div: onnx.NodeProto, producer: dict, operand) -> dict:
    """The layer norm of opsets < 17, written out (TorchScript, Paddle2ONNX, our import of
    them): ``Div(Sub(x, ReduceMean(x)), Sqrt(Add(ReduceMean(Pow(Sub(x, ReduceMean(x)), 2)),
    eps)))`` of one site ``x`` over the same axes: a LayerNormalization with ``gamma = 1``
    (the Mul by gamma after it has its own credit)."""

    def node(t, op):
        n = producer.get(t)
        return n if n is not None and n.op_type == op else None

    def mean_axes(n):
        return _kept_axes(n, operand)

    def centered(t):  # Sub(x, ReduceMean(x)): (x, axes)
        sub = node(t, "Sub")
        if sub is None:
            return None
        mean = node(sub.input[1], "ReduceMean")
        if (
            mean is None
            or mean.input[0] != sub.input[0]
            or not isinstance(operand(sub.input[0]), str)
        ):
            return None
        return operand(sub.input[0]), mean_axes(mean)

    top = centered(div.input[0])
    sqrt = node(div.input[1], "Sqrt")
    if top is None or top[1] is None or sqrt is None:
        return {}
    var_site = operand(sqrt.input[0])
    if isinstance(var_site, str):  # the variance quantized (ONNX Runtime's quantize_static)
        return {"factors": (top[0], var_site), "norm": {"op": "centered_quotient", "axes": top[1]}}
    add = node(sqrt.input[0], "Add")
    if add is None:
        return {}
    kinds = [operand(t) for t in add.input]
    eps = [k for k in kinds if isinstance(k, np.ndarray) and k.size == 1]
    var = [t for t, k in zip(add.input, kinds, strict=True) if not isinstance(k, np.ndarray)]
    var_mean = node(var[0], "ReduceMean") if len(eps) == 1 and len(var) == 1 else None
    power = node(var_mean.input[0], "Pow") if var_mean is not None else None
    two = operand(power.input[1]) if power is not None else None
    if not isinstance(two, np.ndarray) or two.size != 1 or float(two.reshape(())) != 2.0:
        return {}
    if centered(power.input[0]) != top or mean_axes(var_mean) != top[1] or float(eps[0]) < 0:
        return {}
    norm = {"op": "LayerNormalization", "axes": top[1], "epsilon": float(eps[0].reshape(()))}
    return {"factors": (top[0],), "norm": {**norm, "gamma": np.ones(1)}}


def _kept_axes(n: onnx.NodeProto | None, operand) -> tuple[int, ...] | None:
    """The axes of a Reduce* node ``n`` with ``keepdims`` (attribute or constant input)."""
    if n is None:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    if not attrs.get("keepdims", 1):
        return None
    axes = attrs.get("axes")
    if axes is None and len(n.input) > 1 and n.input[1]:
        value = operand(n.input[1])
        axes = None if not isinstance(value, np.ndarray) else value.reshape(-1).tolist()
    return tuple(int(a) for a in axes) if axes else None


def _l2_ratio(div: onnx.NodeProto, producer: dict, operand) -> dict:
    """ConvNeXt-V2's GRN: ``Div(ReduceL2(x, A), Add(ReduceMean(ReduceL2(x, A), B), eps))`` of
    one site ``x``: ``{"factors": (x,), "norm": {"op": "l2_ratio", ...}}`` (``l2_ratio_bound``)."""
    l2, add = producer.get(div.input[0]), producer.get(div.input[1])
    if l2 is None or l2.op_type != "ReduceL2" or add is None or add.op_type != "Add":
        return {}
    x, l2_axes = operand(l2.input[0]), _kept_axes(l2, operand)
    kinds = [operand(t) for t in add.input]
    eps = [k for k in kinds if isinstance(k, np.ndarray) and k.size == 1]
    mean = [producer.get(t) for t, k in zip(add.input, kinds, strict=True) if k is None]
    if not isinstance(x, str) or l2_axes is None or len(eps) != 1 or len(mean) != 1:
        return {}
    mean = mean[0]
    if mean is None or mean.op_type != "ReduceMean" or mean.input[0] != div.input[0]:
        return {}
    mean_axes, e = _kept_axes(mean, operand), float(eps[0].reshape(()))
    if mean_axes is None or not e >= 0:
        return {}
    norm = {"op": "l2_ratio", "l2_axes": l2_axes, "mean_axes": mean_axes, "epsilon": e}
    return {"factors": (x,), "norm": norm}


def l2_ratio_bound(x: np.ndarray, dx: np.ndarray, norm: dict) -> np.ndarray:
    """The largest change of ``n = g / (mean_B g + eps)``, ``g = ||x||_2`` over the axes ``A``,
    when ``x`` moves by at most ``dx`` (element by element), per element of ``n`` (keepdims).
    With ``r = ||dx||_2`` over ``A``: ``|g' - g| <= r`` (triangle inequality), so with
    ``m = mean_B g + eps`` and ``rb = mean_B r``, ``|m' - m| <= rb`` and, for ``m > rb``,

        |n' - n| = |(g' - g) / m' + g (m - m') / (m m')| <= r / (m - rb) + g rb / (m (m - rb))

    (``m' >= m - rb > 0``). Where ``m <= rb``: no credit (0)."""
    x, dx = np.asarray(x, np.float64), np.abs(np.asarray(dx, np.float64))
    if x.shape != dx.shape:
        raise ValueError(f"shapes {x.shape} and {dx.shape}")
    a, b = norm["l2_axes"], norm["mean_axes"]
    g = np.sqrt(np.sum(x * x, axis=a, keepdims=True))
    r = np.sqrt(np.sum(dx * dx, axis=a, keepdims=True))
    m = np.mean(g, axis=b, keepdims=True) + norm["epsilon"]
    rb = np.mean(r, axis=b, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = r / (m - rb) + g * rb / (m * (m - rb))
    return np.where(m > rb, bound, 0.0)


def _attention(matmul: onnx.NodeProto, producer: dict, operand, opset: int) -> dict:
    """``MatMul(Softmax(c * MatMul(q, k)), v)`` of three sites, the scores and probabilities in
    float (attention whose scores are not quantized: PP-OCRv4 rec through import_onnx); ``c`` a
    scalar constant (a Mul, or a Div by it) or absent, data movement allowed after the
    Softmax: ``{"factors": (q, k, v), "norm": {"op": "attention", "scale": c}}``."""
    v = operand(matmul.input[1])
    p = producer.get(matmul.input[0])
    while p is not None and p.op_type in SELECTING_OPS:
        p = producer.get(p.input[0])
    while p is not None and p.op_type == "Where" and _safe_softmax(p, producer):
        p = producer.get(p.input[2])
    if not isinstance(v, str) or p is None or p.op_type != "Softmax" or opset < 13:
        return {}
    axis = next((a.i for a in p.attribute if a.name == "axis"), -1)
    masked = _masked_scores(p.input[0], producer, operand)
    if masked is not None and axis in (-1, 3):
        return {"factors": (masked[0], v), "norm": {"op": "masked_attention", "scale": masked[1]}}
    scores, scale = producer.get(p.input[0]), 1.0
    if scores is not None and scores.op_type in ("Mul", "Div"):
        c = operand(scores.input[1])
        if not isinstance(c, np.ndarray) or c.size != 1 or float(c.reshape(())) == 0.0:
            return {}
        c = float(c.reshape(()))
        scale = c if scores.op_type == "Mul" else 1.0 / c
        scores = producer.get(scores.input[0])
    if scores is None or scores.op_type != "MatMul" or axis not in (-1, 3):
        return {}
    q, k = operand(scores.input[0]), operand(scores.input[1])
    if not isinstance(q, str) or not isinstance(k, str):
        return {}
    return {"factors": (q, k, v), "norm": {"op": "attention", "scale": scale}}


def _safe_softmax(where: onnx.NodeProto, producer: dict) -> bool:
    """``Where(IsNaN(p), c, p)``: torch's safe softmax (a fully masked row's NaN -> c)."""
    cond = producer.get(where.input[0])
    return cond is not None and cond.op_type == "IsNaN" and cond.input[0] == where.input[2]


def _masked_scores(t: str, producer: dict, operand) -> tuple[str, float] | None:
    """``(s, c)`` where ``t`` is ``c * s`` of one site ``s`` (``c`` a scalar constant, a Mul or
    a Div by it, or 1), masked by ``Where(mask, s, constant)`` / ``Where(mask, constant, s)`` or
    ``Add(s, mask)`` with a mask computed from graph inputs and constants only (the same in both
    engines); else None."""
    scale = 1.0
    for _ in range(4):
        site = operand(t)
        if isinstance(site, str):
            return site, scale
        p = producer.get(t)
        if p is None:
            return None
        kinds = [operand(i) for i in p.input]
        if p.op_type in ("Mul", "Div") and len(p.input) == 2 and isinstance(kinds[1], np.ndarray):
            if kinds[1].size != 1 or float(kinds[1].reshape(())) == 0.0:
                return None
            c = float(kinds[1].reshape(()))
            scale *= abs(c) if p.op_type == "Mul" else 1.0 / abs(c)
            t = p.input[0]
        elif p.op_type == "Where" and siteless(p.input[0], producer, operand):
            const = [isinstance(k, np.ndarray) and k.size == 1 for k in kinds[1:]]
            if const == [True, False]:
                t = p.input[2]
            elif const == [False, True]:
                t = p.input[1]
            else:
                return None
        elif p.op_type == "Add" and len(p.input) == 2 and siteless(p.input[1], producer, operand):
            t = p.input[0]
        else:
            return None
    return None


def masked_where(node: onnx.NodeProto, producer: dict, sites) -> bool:
    """A ``Where`` whose condition is computed from graph inputs and constants alone (a mask):
    the same in both engines, so each output element is one branch's and carries that branch's
    error (``_match._upstream``'s unit gain)."""

    def site_of(t: str) -> str | None:
        p = producer.get(t)
        read = p is not None and p.op_type == "DequantizeLinear" and p.input[0] in sites
        return t if t in sites or read else None

    return node.op_type == "Where" and siteless(node.input[0], producer, site_of)


def siteless(t: str, producer: dict, operand, limit: int = 64) -> bool:
    """Whether ``t`` is computed from graph inputs and constants alone (no quantized site)."""
    todo, seen = [t], set()
    while todo:
        u = todo.pop()
        if not u or u in seen:
            continue
        seen.add(u)
        if isinstance(operand(u), str) or len(seen) > limit:
            return False
        p = producer.get(u)
        if p is not None:
            todo.extend(p.input)
    return True


def masked_attention_bound(values: list, diffs: list, norm: dict) -> np.ndarray:
    """``MatMul(Softmax(mask(c * s)), v)`` (``_masked_scores``; torch's safe-softmax ``Where``
    allowed), bounded without the mask: ``P' v' - P v = (P' - P) v + P' (v' - v)``, ``P'`` a
    probability row (or zeros), so ``|P' dv| <= max_j |dv_j|``; and ``|P' - P|_1 <= sum_j p_j
    (exp(|dS_j| + D) - 1) <= exp(2 D) - 1`` (the softmax bound, ``D`` the row's largest score
    difference, masked entries equal in both), so ``|(P' - P) v| <= (exp(2 D) - 1) max_j |v_j|``
    (and ``|P' - P|_1 <= 2``). Element by element over the output's columns."""
    _, v = (np.asarray(a, np.float64) for a in values)
    ds, dv = (np.abs(np.asarray(d, np.float64)) for d in diffs)
    d_row = abs(norm["scale"]) * np.max(ds, axis=-1, keepdims=True)  # [..., T, 1]
    # expm1 is capped before it overflows (1.1 > ln 3: the same value, no RuntimeWarning)
    spread = np.minimum(np.expm1(np.minimum(2.0 * d_row, 1.1)), 2.0)
    v_top = np.max(np.abs(v), axis=-2, keepdims=True)  # [..., 1, d]: per output column
    dv_top = np.max(dv, axis=-2, keepdims=True)
    return spread * v_top + dv_top


def attention_bound(values: list, diffs: list, norm: dict) -> np.ndarray:
    """``_attention``'s bound (float64): the product bound of the scores ``c q @ k``, the
    softmax bound of the probabilities ``P`` from it, then the product bound of ``P @ v``:
    ``|dS| <= |c| (|dq| @ |k| + |q| @ |dk| + |dq| @ |dk|)``, ``|dP| <= P (exp(|dS| + max
    |dS|) - 1)``, ``|d(P v)| <= |dP| @ |v| + P @ |dv| + |dP| @ |dv|``."""
    q, k, v = (np.asarray(x, np.float64) for x in values)
    dq, dk, dv = (np.abs(np.asarray(d, np.float64)) for d in diffs)
    c = abs(norm["scale"])
    scores = norm["scale"] * np.matmul(q, k)
    ds = c * (np.matmul(dq, np.abs(k)) + np.matmul(np.abs(q), dk) + np.matmul(dq, dk))
    m = np.max(scores, axis=-1, keepdims=True)
    e = np.exp(scores - m)
    p = e / np.sum(e, axis=-1, keepdims=True)
    dp = p * np.expm1(ds + np.max(ds, axis=-1, keepdims=True))
    return np.matmul(dp, np.abs(v)) + np.matmul(p, dv) + np.matmul(dp, dv)


def quotient_bound(values: list, diffs: list, norm: dict) -> np.ndarray:
    """The written-out layer norm with its variance quantized, ``(x - mean x) / sqrt(v)`` of
    two sites ``x``, ``v`` (float64): with ``n = x - mean x``, ``s = sqrt v``, ``q = n / s``,
    exactly ``q' - q = (dn + q (s - s')) / s'``; ``|dn_i| <= D_i + mean D``, and ``sqrt`` being
    concave, ``|s - s'| <= sqrt(v) - sqrt(max(v - Dv, 0))`` and ``s' >= sqrt(max(v - Dv, 0))``.
    So ``|dq| <= (D_i + mean D + |q| (s - s_low)) / s_low``; 0 (no credit) where ``s_low = 0``."""
    x, v = (np.asarray(a, np.float64) for a in values)
    dx, dv = (np.abs(np.asarray(d, np.float64)) for d in diffs)
    axes = tuple(sorted({a % x.ndim for a in norm["axes"]}))
    n = x - np.mean(x, axis=axes, keepdims=True)
    s, low = np.sqrt(np.maximum(v, 0.0)), np.sqrt(np.maximum(v - dv, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        q = n / s
        bound = (dx + np.mean(dx, axis=axes, keepdims=True) + np.abs(q) * (s - low)) / low
    return np.where(np.broadcast_to(low > 0, bound.shape) & np.isfinite(bound), bound, 0.0)


def norm_bound(x: np.ndarray, dx: np.ndarray, norm: dict) -> np.ndarray:
    """The bound of the module docstring, element by element (float64): ``x`` the reference's
    input, ``dx`` the pair's input differences (``>= 0``). ValueError where shapes do not fit."""
    x, dx = np.asarray(x, np.float64), np.abs(np.asarray(dx, np.float64))
    for op, arg in norm.get("pre", ()):  # ``_pooled``: the same moves / means of x and |dx|
        if op == "Transpose":
            x, dx = np.transpose(x, arg), np.transpose(dx, arg)
        else:
            x, dx = np.mean(x, axis=arg, keepdims=True), np.mean(dx, axis=arg, keepdims=True)
    dx = np.broadcast_to(dx, x.shape)
    axis = norm.get("axis", -1) % max(x.ndim, 1)
    if norm["op"] == "Softmax":
        m = np.max(x, axis=axis, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(x - m)
        p = e / np.sum(e, axis=axis, keepdims=True)
        return p * np.expm1(dx + np.max(dx, axis=axis, keepdims=True))
    axes = tuple(sorted({a % x.ndim for a in norm.get("axes", range(axis, x.ndim))}))
    mu = np.mean(x, axis=axes, keepdims=True)
    sigma = np.sqrt(np.mean((x - mu) ** 2, axis=axes, keepdims=True) + norm["epsilon"])
    r = np.sqrt(np.mean(dx**2, axis=axes, keepdims=True))
    z = (x - mu) / sigma
    spare = sigma - r
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = (dx + np.mean(dx, axis=axes, keepdims=True) + np.abs(z) * r) / spare
    bound = np.where(spare > 0, bound, 0.0)
    return norm["gamma"] * bound
