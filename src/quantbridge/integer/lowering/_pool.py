"""Lowering of MaxPool, ReduceMax and ReduceMin (on codes, no rescale; after the
requantization of a pending kernel, with which they commute), AveragePool, GlobalAveragePool and ReduceMean (integer window sums
and one requantization by ``s_x / (count * s_y)``; ``kernels._pool`` states the pipeline), and
ReduceSum (the same sums, requantized by ``s_x / s_y``), ReduceL2 (``_l2``); a reduction of a
constant (ReduceL2 in a weight norm's ``g * v / ||v||``) is folded.

An average reads codes, or a float result that no QuantizeLinear follows, realized first on
symmetric int16 codes (``_averaged_input``): a bounded one (a layer norm, a residual sum, Swin's
pooler) on its bound's grid, a function of 8-bit codes (EfficientNet's SiLU before its pool) as a
table onto the grid of its largest value, a group norm's normalized value (PoolFormer) as its codes."""

from __future__ import annotations

import numpy as np
import onnx

from ...numerics import fixed_point_multipliers
from .._program import QTensor
from ._core import (
    Builder,
    Const,
    Elementwise,
    LoweringError,
    Pending,
    QValue,
    Value,
    as_activation,
    attrs_of,
    code_range,
    describe_node,
    node_name,
    register_lowering,
)
from ._groupnorm import Normalized, as_codes
from ._l2 import l2_norm_value
from ._movement import moved, tabled
from ._qdq import float_result_codes
from ._rms import RowMean, mean_of_squares
from ._unit_axis import lifted


def _window(b: Builder, node: onnx.NodeProto, ranks: tuple[int, ...] = (2,)) -> dict:
    """The pool's window attributes, its spatial rank one of ``ranks`` (1-D pools come here as
    their 2-D forms, ``_unit_axis``; a max of codes also takes 3-D windows)."""
    a = attrs_of(node)
    kernel = tuple(a["kernel_shape"])
    rank = len(kernel)
    auto_pad = a.get("auto_pad", b"NOTSET")
    if rank not in ranks or auto_pad not in (b"NOTSET", "NOTSET"):
        raise LoweringError(f"{describe_node(node)}: only {'/'.join(f'{r}-D' for r in ranks)} "
                            "pools with explicit pads are lowered here (export with padding=... "
                            "rather than auto_pad)")  # fmt: skip
    if a.get("storage_order", 0):
        raise LoweringError(f"{describe_node(node)}: storage_order=1 is not lowered")
    window = {
        "kernel": kernel,
        "strides": tuple(a.get("strides", [1] * rank)),
        "pads": tuple(a.get("pads", [0] * 2 * rank)),
        "dilations": tuple(a.get("dilations", [1] * rank)),
    }
    if a.get("ceil_mode", 0):
        window["pads"] = _ceil_pads(b, node, window)
    return window


def _ceil_pads(b: Builder, node: onnx.NodeProto, window: dict) -> tuple[int, ...]:
    """``ceil_mode=1`` as ``ceil_mode=0`` with more padding at the end of each axis: the output
    has ``ceil((n + pads - dk) / s) + 1`` positions, less the last when it would start in the
    end padding (ONNX, torch). The extra cells pad as the pool's own pads do (a sum adds 0
    there, a max ignores them) and the averaging counts leave them out (``_counts``)."""
    pads = list(window["pads"])
    for i, (k, s, d) in enumerate(zip(window["kernel"], window["strides"], window["dilations"],
                                      strict=True)):  # fmt: skip
        n = b.dim(node.input[0], 2 + i)
        if n is None:
            raise LoweringError(f"{describe_node(node)}: ceil_mode=1 needs static spatial sizes; "
                                "pass lower(..., input_shapes=...)")  # fmt: skip
        span = (k - 1) * d + 1
        end = i + len(window["kernel"])
        out = -(-(n + pads[i] + pads[end] - span) // s) + 1
        if (out - 1) * s >= n + pads[i]:
            out -= 1
        pads[end] += max(0, (out - 1) * s + span - (n + pads[i] + pads[end]))
    return tuple(pads)


def _increasing(node: onnx.NodeProto, v: Value | None) -> Value | None:
    """``v``, or, for a float function of codes that is not non-decreasing (dpn's SiLU ->
    MaxPool), that function tabled onto the grid of the QuantizeLinear that reads the max / min:
    ``max`` moves through ``f`` to the codes only when ``f`` keeps their order, but it always
    moves through the (non-decreasing) quantization, so ``Q(max f(x)) = max Q(f(x))`` exactly."""
    if isinstance(v, Elementwise):
        t = v.source
        r = (np.arange(t.qmin, t.qmax + 1, dtype=np.float64) - t.zero_point) * t.scale
        with np.errstate(all="ignore"):
            f = np.asarray(v.fn(r), np.float64) * np.ones_like(r)
        if not np.all(np.diff(f) >= 0):
            return tabled(v)
    return v


@register_lowering("MaxPool")
def _maxpool(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    if len(attrs_of(node).get("kernel_shape", ())) == 1:  # MaxPool1d: 2-D with a unit height
        return lifted(b, node, ins, _maxpool)
    if len(node.output) > 1 and node.output[1]:
        raise LoweringError(f"{describe_node(node)}: the Indices output is not lowered")
    window = _window(b, node, (2, 3))
    return [moved(b, node, _increasing(node, ins[0]), "maxpool", window)]


def _reduce_axes(node: onnx.NodeProto, ins: list[Value | None], a: dict) -> list[int] | None:
    """A Reduce* node's axes: its ``axes`` input (opset 18; a constant) or attribute."""
    if len(ins) > 1 and ins[1] is not None:
        if not isinstance(ins[1], Const):
            raise LoweringError(f"{describe_node(node)}: axes must be a constant")
        return [int(v) for v in np.asarray(ins[1].array).reshape(-1)]
    return a.get("axes")


@register_lowering("ReduceMax", "ReduceMin")
def _reduce_extreme(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """``max`` / ``min`` of codes: ``r = s(q - z)`` is increasing in ``q`` (s > 0), so they
    commute with dequantization and with the (monotone) requantization of a pending kernel."""
    a = attrs_of(node)
    axes = _reduce_axes(node, ins, a)
    if not axes and a.get("noop_with_empty_axes", 0):
        return [moved(b, node, ins[0], "identity", {})]
    op = "reduce_max" if node.op_type == "ReduceMax" else "reduce_min"
    axes = tuple(axes) if axes else None
    x = _increasing(node, ins[0])
    return [moved(b, node, x, op, {"axes": axes, "keepdims": bool(a.get("keepdims", 1))})]


def _averaged_input(b: Builder, node: onnx.NodeProto, v: Value | None) -> QTensor:
    """The codes an average reads (module docstring): half an int16 step of error per element
    for a float result, so the mean is within one int16 step of its float value."""
    codes = float_result_codes(b, node, v)
    if codes is not None:
        return codes
    if isinstance(v, Normalized):  # PoolFormer: pool(GroupNorm(x)) - GroupNorm(x)
        return as_codes(b, v).tensor
    return as_activation(node, v)


def _averaging(b, node, x: QTensor, op: str, counts: np.ndarray, terms: float | None = None,
               **attrs) -> Pending:  # fmt: skip
    """``sum / counts`` of ``terms`` codes (default: ``counts``) per output, requantized."""
    name = node_name(node)
    bound = float(code_range(x, x.zero_point) * (terms or counts.max()))
    bits = b.check_accumulator(name, bound)

    def realize(builder: Builder, out: QTensor, qmin: int, qmax: int) -> None:
        multiplier, shift = fixed_point_multipliers(x.scale / (counts * out.scale), bits)
        builder.step(op, name, [x], out, x_zero=x.zero_point, multiplier=multiplier,
                     shift=shift, out_zero=out.zero_point, qmin=qmin, qmax=qmax,
                     dtype=out.dtype, **attrs)  # fmt: skip

    # a mean of values on x's grid stays within its real range: a float graph output (a
    # backbone's pooled features, HF RegNet's pooler_output) goes on an int16 grid (_outputs)
    return Pending(name, realize, bound=x.scale * code_range(x, x.zero_point))


def _counts(b: Builder, node: onnx.NodeProto, window: dict, include_pad: bool) -> np.ndarray:
    """Elements averaged at each output position: the kernel size, or (padding excluded and
    pads present, or ``ceil_mode``'s extra end padding, never counted) an (OH, OW) array from
    the static input shape."""
    kh, kw = window["kernel"]
    real = tuple(attrs_of(node).get("pads", [0, 0, 0, 0]))
    pads = window["pads"]
    if tuple(pads) == real and (include_pad or not any(pads)):
        return np.array(kh * kw, dtype=np.float64)
    h, w = b.dim(node.input[0], -2), b.dim(node.input[0], -1)
    if h is None or w is None:
        raise LoweringError(f"{describe_node(node)}: padded average pool needs a static H, W")
    (sh, sw), (dh, dw) = window["strides"], window["dilations"]
    ones = np.pad(np.ones((h, w)), ((real[0], real[2]), (real[1], real[3])),
                  constant_values=1.0 if include_pad else 0.0)  # fmt: skip
    ones = np.pad(ones, ((0, pads[2] - real[2]), (0, pads[3] - real[3])))
    win = np.lib.stride_tricks.sliding_window_view(ones, ((kh - 1) * dh + 1, (kw - 1) * dw + 1))
    return win[::sh, ::sw, ::dh, ::dw].sum(axis=(-2, -1))


@register_lowering("AveragePool")
def _average_pool(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    if len(attrs_of(node).get("kernel_shape", ())) == 1:  # AvgPool1d: 2-D with a unit height
        return lifted(b, node, ins, _average_pool)
    x = _averaged_input(b, node, ins[0])
    window = _window(b, node)
    counts = _counts(b, node, window, bool(attrs_of(node).get("count_include_pad", 0)))
    return [_averaging(b, node, x, "avgpool", counts, **window)]


def _reduce(b: Builder, node: onnx.NodeProto, x: QTensor, axes: list[int], keepdims: bool):
    dims = [b.dim(node.input[0], a) for a in axes]
    if any(d is None for d in dims):
        raise LoweringError(f"{describe_node(node)}: averaged axes {axes} need static sizes")
    counts = np.array(float(np.prod(dims)))
    return _averaging(b, node, x, "reduce_mean", counts, axes=tuple(axes), keepdims=keepdims)


@register_lowering("GlobalAveragePool")
def _global_average_pool(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    x = _averaged_input(b, node, ins[0])
    rank = len(b.shapes.get(node.input[0]) or ())
    if rank < 3:
        raise LoweringError(f"{describe_node(node)}: needs the input's rank (shape inference)")
    return [_reduce(b, node, x, list(range(2, rank)), True)]


@register_lowering("ReduceMean")
def _reduce_mean(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    a = attrs_of(node)
    axes = _reduce_axes(node, ins, a)
    if not axes:
        raise LoweringError(f"{describe_node(node)}: reducing over all axes is not lowered")
    rank = len(b.shapes.get(node.input[0]) or ())
    axes = [ax % rank if rank else ax for ax in axes]
    squares = mean_of_squares(b, node, ins[0], axes, bool(a.get("keepdims", 1)))
    if squares is not None:  # RMSNorm's mean(x**2)
        return [squares]
    x = _averaged_input(b, node, ins[0])
    mean = _reduce(b, node, x, axes, bool(a.get("keepdims", 1)))
    n = b.dim(node.input[0], -1)
    if isinstance(ins[0], QValue) and rank and axes == [rank - 1] and a.get("keepdims", 1) and n:
        return [RowMean(mean.node, mean.realize, mean.lo, mean.hi, mean.bound, mean.accumulator,
                        source=x, n=int(n))]  # fmt: skip
    return [mean]


REDUCE_FOLD = {"ReduceSum": lambda x, axes, keep: np.sum(x, axis=axes, keepdims=keep),
               "ReduceL2": lambda x, axes, keep: np.sqrt(np.sum(np.square(x), axis=axes,
                                                                keepdims=keep))}  # fmt: skip


@register_lowering("ReduceSum", "ReduceL2")
def _reduce_sum(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    """A constant's reduction folds (WavLM's weight-normed positional conv: ``||v||`` of its
    float ``v``); ``ReduceSum`` of a quantized tensor is an integer sum of codes (WavLM's
    gated relative position bias, ``sum(-1) -> Sigmoid``), bounded by ``N`` times its range."""
    a = attrs_of(node)
    axes = _reduce_axes(node, ins, a)
    keep = bool(a.get("keepdims", 1))
    if not axes and a.get("noop_with_empty_axes", 0):
        return [moved(b, node, ins[0], "identity", {})]
    if isinstance(ins[0], Const):
        x = np.asarray(ins[0].array)
        folded = REDUCE_FOLD[node.op_type](x, tuple(axes) if axes else None, keep)
        return [Const(np.asarray(folded, x.dtype))]
    if not axes:
        raise LoweringError(f"{describe_node(node)}: reducing over all axes is not lowered")
    if node.op_type == "ReduceL2":  # F.normalize, GRN: isqrt of the sum of squares (_l2)
        return [l2_norm_value(b, node, _averaged_input(b, node, ins[0]), axes, keep)]
    x = as_activation(node, ins[0])
    rank = len(b.shapes.get(node.input[0]) or ())
    axes = [ax % rank if rank else ax for ax in axes]
    dims = [b.dim(node.input[0], ax) for ax in axes]
    if any(d is None for d in dims):
        raise LoweringError(f"{describe_node(node)}: summed axes {axes} need static sizes")
    n = float(np.prod(dims))
    total = _averaging(b, node, x, "reduce_mean", np.array(1.0), n, axes=tuple(axes),
                       keepdims=keep)  # fmt: skip
    return [Pending(total.node, total.realize, bound=total.bound * n)]
