"""``compare``'s credit for a float graph output that combines two float weighted outputs:
``(y1 +- y2) * c`` (or ``/ c``), each ``y_i`` a Linear or conv of one quantized tensor in float,
possibly then a Sigmoid / Tanh (``_gain.weighted_output``: ``|dy_i| <= |lin_i(dx_i)|`` element by
element, ``lin_i`` the op by its weight times the activation's slope bound), ``c`` a scalar
constant. By the triangle inequality the output changes by at most ``|c| (|dy1| + |dy2|)``,
element by element (two float heads averaged: timm's distilled ViT ``(head(x) +
head_dist(x_dist)) / 2`` when the sum is left float).
"""

from __future__ import annotations

import math

import numpy as np

from ._gain import conv_bound, weighted_output


def weighted_sum_output(tensor: str, producer: dict, operand) -> dict:
    """A float graph output ``(y1 +- y2) * c`` (or ``/ c``), ``y1``, ``y2`` two float outputs of
    ``weighted_output`` (two float heads averaged: timm's distilled ViT ``(head(x) +
    head_dist(x_dist)) / 2``), ``c`` a scalar constant: ``{"factors": (x1, x2), "terms":
    ((|c| L1 W1, conv1), (|c| L2 W2, conv2))}``. Its change is at most ``|c| (|dy1| + |dy2|)``
    element by element, each ``|dy_i| <= |lin_i(dx_i)|`` (``weighted_output``): ``terms_bound``."""
    p, c = producer.get(tensor), 1.0
    if p is not None and p.op_type in ("Mul", "Div") and len(p.input) == 2:
        kinds = [operand(t) for t in p.input]
        const = [i for i, k in enumerate(kinds) if isinstance(k, np.ndarray) and k.size == 1]
        if len(const) != 1 or (p.op_type == "Div" and const[0] != 1):
            return {}
        k = float(kinds[const[0]].reshape(()))
        if k == 0.0 or not math.isfinite(k):
            return {}
        c, p = abs(k if p.op_type == "Mul" else 1.0 / k), producer.get(p.input[1 - const[0]])
    if p is None or p.op_type not in ("Add", "Sub") or len(p.input) != 2:
        return {}
    found = [weighted_output(t, producer, operand) for t in p.input]
    if not all(found):
        return {}
    terms = tuple((f["weight"] * c, f.get("conv")) for f in found)
    return {"factors": tuple(f["factors"][0] for f in found), "terms": terms}


def terms_bound(dxs: list, terms: tuple) -> np.ndarray:
    """``sum_i |lin_i(dx_i)|`` (float64, element by element) for ``weighted_sum_output``'s
    terms, ``lin_i`` the MatMul by ``W_i`` or its conv; ValueError or RuntimeError where the
    shapes do not fit."""
    bound = 0.0
    for dx, (w, conv) in zip(dxs, terms, strict=True):
        bound = bound + np.abs(np.matmul(dx, w) if conv is None else conv_bound(dx, w, conv))
    return np.asarray(bound, np.float64)
