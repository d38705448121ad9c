"""Elementwise, activation, reduction and softmax ops of ``import_onnx`` (one torch line each).

Broadcasting: ONNX's multidirectional broadcasting is numpy's, which is torch's. Size-1
constants arrive as numpy arrays and become python scalars (``operand``), so ``Mul(x, 0.5)``
captures as ``aten.mul.Tensor(x, 0.5)`` exactly as ``x * 0.5`` in a hand-written model.
Integer ``Div`` truncates toward zero (ONNX), not floor. ``Softmax`` before opset 13 flattens
the input to 2-D at ``axis`` (a softmax over all trailing dimensions together); from 13 it is a
softmax over ``axis`` alone. Reductions read ``axes`` from an attribute before opset 13
(``ReduceSum``) / 18 (the others), from an input after.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
import torch
import torch.nn.functional as F

from ._registry import (
    as_tensor,
    ints,
    normalize_axes,
    numpy_dtype,
    operand,
    register,
    torch_dtype,
)


# -- elementwise binary ------------------------------------------------------------------------
def _trunc_div(a, b):
    if object in (getattr(a, "dtype", None), getattr(b, "dtype", None)):
        return a // b  # python sizes: non-negative, where floor and truncation agree
    q = np.abs(a) // np.abs(b)
    return (q * np.sign(a) * np.sign(b)).astype(np.result_type(a, b))


def _host_div(node, a, b):
    if np.issubdtype(np.result_type(a.dtype if a.dtype != object else np.int64, b), np.floating):
        return np.asarray(a / b)
    return _trunc_div(a, b)


def _div(node, a, b):
    a, b = operand(a), operand(b)
    floating = any(
        isinstance(v, float) or (torch.is_tensor(v) and v.is_floating_point()) for v in (a, b)
    )
    if floating:
        return a / b
    return torch.div(as_tensor(a), b, rounding_mode="trunc")


_PYTHON_OPERATORS = (operator.add, operator.sub, operator.mul, operator.pow)
_BINARY = {
    "Add": (operator.add, np.add),
    "Sub": (operator.sub, np.subtract),
    "Mul": (operator.mul, np.multiply),
    "Pow": (operator.pow, None),
    "Equal": (torch.eq, np.equal),
    "Greater": (torch.gt, np.greater),
    "Less": (torch.lt, np.less),
    "GreaterOrEqual": (torch.ge, np.greater_equal),
    "LessOrEqual": (torch.le, np.less_equal),
    "And": (torch.logical_and, np.logical_and),
    "Or": (torch.logical_or, np.logical_or),
    "Xor": (torch.logical_xor, np.logical_xor),
}


def _binary(torch_fn):
    def fn(node, a, b):
        a, b = operand(a), operand(b)
        if not torch.is_tensor(a) and torch_fn not in _PYTHON_OPERATORS:
            a = torch.as_tensor(a, dtype=b.dtype)  # torch.eq(scalar, tensor) has no overload
        return torch_fn(a, b)

    return fn


def _host_binary(np_fn):
    return lambda node, a, b: np.asarray(np_fn(a, b))


for _op, (_torch_fn, _np_fn) in _BINARY.items():
    register(
        _op,
        host=_host_binary(_np_fn) if _np_fn is not None else None,
        elementwise=True,
    )(_binary(_torch_fn))
register("Div", host=_host_div, elementwise=True)(_div)


def _host_mod(node, a, b):
    """Sizes modulo a window (Swin/EfficientViT padding arithmetic) stay python sizes."""
    return np.asarray(np.fmod(a, b) if node.attr("fmod", 0) else np.remainder(a, b))


@register("Mod", host=_host_mod, elementwise=True)
def _mod(node, a, b):
    a, b = as_tensor(a), operand(b)
    return torch.fmod(a, b) if node.attr("fmod", 0) else torch.remainder(a, b)


def _variadic(torch_fn, np_fn):
    def fn(node, *xs):
        values = [operand(x) for x in xs]
        if not torch.is_tensor(values[0]):
            values[0] = as_tensor(xs[0])
        return functools.reduce(torch_fn, values)

    def host(node, *xs):
        return np.asarray(functools.reduce(np_fn, xs))

    return fn, host


for _op, (_torch_fn, _np_fn) in {
    "Sum": (lambda a, b: a + b, np.add),
    "Max": (torch.maximum, np.maximum),
    "Min": (torch.minimum, np.minimum),
}.items():
    _fn, _host = _variadic(_torch_fn, _np_fn)
    register(_op, host=_host, elementwise=True)(_fn)


@register("Mean", elementwise=True)
def _mean(node, *xs):
    return functools.reduce(lambda a, b: a + b, [as_tensor(x) for x in xs]) / len(xs)


@register("Where", host=lambda node, c, a, b: np.where(c, a, b), elementwise=True)
def _where(node, cond, a, b):
    dtype = next((x.dtype for x in (a, b) if isinstance(x, np.ndarray)), None)
    a, b = operand(a), operand(b)
    if not torch.is_tensor(a) and not torch.is_tensor(b):  # keep the constants' dtype (float32)
        a = as_tensor(np.asarray(a, dtype=dtype))
    return torch.where(as_tensor(cond), a, b)


# -- unary ---------------------------------------------------------------------------------------
_UNARY = {
    "Relu": torch.relu,
    "Sigmoid": torch.sigmoid,
    "Tanh": torch.tanh,
    "Exp": torch.exp,
    "Log": torch.log,
    "Abs": torch.abs,
    "Sqrt": torch.sqrt,
    "Reciprocal": torch.reciprocal,
    "Floor": torch.floor,
    "Ceil": torch.ceil,
    "Round": torch.round,  # half to even, as ONNX
    "Erf": torch.erf,
    "Sin": torch.sin,
    "Cos": torch.cos,
    "Sign": torch.sign,
    "Softsign": F.softsign,
    "Softplus": F.softplus,
}
for _op, _torch_fn in _UNARY.items():
    register(_op)(lambda node, x, _f=_torch_fn: _f(as_tensor(x)))
register("Neg", host=lambda node, x: np.negative(x))(lambda node, x: -as_tensor(x))


def _host_not(node, x):
    """``Not`` of a size comparison (legacy ``torch.div(h, 2, rounding_mode="floor")`` writes
    ``Div, Mod, Less, Xor, Not, And, Where``) stays python, so the sizes after it do too."""
    if x.dtype == object:  # SymBools under torch.export
        return np.asarray(np.frompyfunc(torch.sym_not, 1, 1)(x), dtype=object)
    return np.logical_not(x)


register("Not", host=_host_not)(lambda node, x: torch.logical_not(as_tensor(x)))
register("IsNaN", since=9, host=lambda node, x: np.isnan(x))(
    lambda node, x: torch.isnan(as_tensor(x))
)


def _isinf_mask(node, x, isinf, positive, negative):
    """IsInf's ``detect_positive`` / ``detect_negative`` (both on by default)."""
    pos, neg = node.attr("detect_positive", 1), node.attr("detect_negative", 1)
    if pos and neg:
        return isinf(x)
    if pos:
        return positive(x)
    return negative(x) if neg else positive(x) & negative(x)  # neither: all False


register(
    "IsInf", since=10, host=lambda node, x: _isinf_mask(node, x, np.isinf, np.isposinf, np.isneginf)
)(lambda node, x: _isinf_mask(node, as_tensor(x), torch.isinf, torch.isposinf, torch.isneginf))


@register("LeakyRelu")
def _leaky_relu(node, x):
    return F.leaky_relu(x, node.attr("alpha", 0.01))


@register("Elu")
def _elu(node, x):
    return F.elu(x, node.attr("alpha", 1.0))


@register("Selu")
def _selu(node, x):
    alpha, gamma = (
        node.attr("alpha", 1.67326319217681884765625),
        node.attr("gamma", 1.05070102214813232421875),
    )
    return gamma * torch.where(x > 0, x, alpha * (torch.exp(x) - 1))


@register("HardSigmoid")
def _hard_sigmoid(node, x):
    # max(0, min(1, alpha * x + beta)) exactly; F.hardsigmoid fixes alpha = 1/6
    return torch.clamp(x * node.attr("alpha", 0.2) + node.attr("beta", 0.5), 0.0, 1.0)


@register("HardSwish", since=14)
def _hard_swish(node, x):
    return F.hardswish(x)


@register("Gelu", since=20)
def _gelu(node, x):
    return F.gelu(x, approximate=node.attr("approximate", "none"))


@register("Mish", since=18)
def _mish(node, x):
    return F.mish(x)


@register("ThresholdedRelu", since=10)
def _thresholded_relu(node, x):
    return torch.where(x > node.attr("alpha", 1.0), x, torch.zeros_like(x))


@register("PRelu")
def _prelu(node, x, slope):
    return torch.where(x >= 0, x, x * as_tensor(slope))


@register("Clip", since=6)
def _clip_attributes(node, x):
    return torch.clamp(x, node.attr("min", -math.inf), node.attr("max", math.inf))


@register("Clip", since=11, static=(1, 2))
def _clip(node, x, lo=None, hi=None):
    return torch.clamp(x, _bound(lo), _bound(hi))


def _bound(v):
    if v is None or torch.is_tensor(v):
        return v
    return np.asarray(v).item()


# -- cast ----------------------------------------------------------------------------------------
def _host_cast(node, x):
    dtype = numpy_dtype(node.attr("to"))
    if x.dtype == object:
        if np.issubdtype(dtype, np.integer):
            return x
        return np.asarray([torch.sym_float(v) for v in x.reshape(-1)], dtype=object).reshape(
            x.shape
        )
    return x.astype(dtype)


@register("Cast", host=_host_cast)
def _cast(node, x):
    return as_tensor(x).to(torch_dtype(node.attr("to"), node))


@register("CastLike", since=15)
def _cast_like(node, x, like):
    return as_tensor(x).to(as_tensor(like).dtype)


@register(("Identity", "Dropout"), host=lambda node, x, *rest: x, static=(1, 2))
def _identity(node, x, *rest):
    """Dropout is imported for inference: the identity (ratio and training_mode ignored)."""
    if len(node.outputs) > 1 and node.outputs[1]:
        return x, torch.ones_like(as_tensor(x), dtype=torch.bool)
    return x


# -- softmax -------------------------------------------------------------------------------------
def _coerced(torch_fn):
    """Opset < 13: the input is flattened to 2-D at ``axis`` and the op runs over dim 1."""

    def fn(node, x):
        rank = node.rank(0, x)
        axis = normalize_axes([node.attr("axis", 1)], rank)[0]
        if axis == rank - 1:
            return torch_fn(x, -1)
        shape = x.shape
        return torch_fn(x.reshape(math.prod(shape[:axis]), -1), -1).reshape(shape)

    return fn


def _hardmax(x, dim):
    index = x.argmax(dim, keepdim=True)
    return torch.zeros_like(x).scatter_(dim, index, 1.0)


for _op, _torch_fn in {
    "Softmax": torch.softmax,
    "LogSoftmax": torch.log_softmax,
    "Hardmax": _hardmax,
}.items():
    register(_op, since=1)(_coerced(_torch_fn))
    register(_op, since=13)(lambda node, x, _f=_torch_fn: _f(x, node.attr("axis", -1)))


# -- reductions ----------------------------------------------------------------------------------
def _reduce(torch_fn):
    def fn(node, x, axes=None):
        if axes is None:
            axes = node.attr("axes")
        axes = ints(axes) if axes is not None else []
        keep = bool(node.attr("keepdims", 1))
        if not axes:
            if node.attr("noop_with_empty_axes", 0):
                return x
            axes = list(range(node.rank(0, x)))
        return torch_fn(x, normalize_axes(axes, node.rank(0, x)), keep)

    return fn


def _prod(x, dims, keep):
    for d in sorted(dims, reverse=True):
        x = x.prod(d, keepdim=keep)
    return x


_REDUCTIONS = {
    "ReduceMean": lambda x, d, k: x.mean(d, keepdim=k),
    "ReduceSum": lambda x, d, k: x.sum(d, keepdim=k),
    "ReduceMax": lambda x, d, k: x.amax(d, keepdim=k),
    "ReduceMin": lambda x, d, k: x.amin(d, keepdim=k),
    "ReduceProd": _prod,
    "ReduceSumSquare": lambda x, d, k: (x * x).sum(d, keepdim=k),
    "ReduceL1": lambda x, d, k: x.abs().sum(d, keepdim=k),
    "ReduceL2": lambda x, d, k: (x * x).sum(d, keepdim=k).sqrt(),
    "ReduceLogSum": lambda x, d, k: x.sum(d, keepdim=k).log(),
    "ReduceLogSumExp": lambda x, d, k: torch.logsumexp(x, d, keepdim=k),
}


def _host_reduce(np_fn):
    def host(node, x, axes=None):
        axes = ints(axes) if axes is not None else node.attr("axes")
        keep = bool(node.attr("keepdims", 1))
        if not axes and node.attr("noop_with_empty_axes", 0):
            return x
        axis = tuple(normalize_axes(axes, x.ndim)) if axes else None
        return np.asarray(np_fn(x, axis=axis, keepdims=keep))

    return host


_HOST_REDUCTIONS = {
    "ReduceProd": np.prod,
    "ReduceSum": np.sum,
    "ReduceMax": np.max,
    "ReduceMin": np.min,
}

for _op, _torch_fn in _REDUCTIONS.items():
    host = _host_reduce(_HOST_REDUCTIONS[_op]) if _op in _HOST_REDUCTIONS else None
    register(_op, since=1, host=host)(_reduce(_torch_fn))
    register(_op, since=13 if _op == "ReduceSum" else 18, host=host, static=(1,))(
        _reduce(_torch_fn)
    )


def _arg(torch_fn):
    def fn(node, x):
        axis = node.attr("axis", 0)
        keep = bool(node.attr("keepdims", 1))
        if node.attr("select_last_index", 0):
            axis = normalize_axes([axis], node.rank(0, x))[0]
            n = x.shape[axis]
            return n - 1 - torch_fn(x.flip(axis), axis, keepdim=keep)
        return torch_fn(x, axis, keepdim=keep)

    return fn


register("ArgMax")(_arg(torch.argmax))
register("ArgMin")(_arg(torch.argmin))


@register("Einsum", since=12)
def _einsum(node, *xs):
    return torch.einsum(node.attr("equation"), *[as_tensor(x) for x in xs])
