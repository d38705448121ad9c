"""Activation ranges limited to the interval their readers can tell apart.

A value read only by ops that are constant outside an interval [lo, hi] needs its grid to cover
that interval only: ``relu(x)`` is 0 for every x <= 0, ``clamp(x, a, b)`` is a or b outside
[a, b], ``hardswish(x)`` is 0 for every x <= -3, and so is its decomposed form
``x * clamp(x + 3, 0, 6) / 6`` (Paddle2ONNX, PP-LCNet; the product is 0 wherever the clamp is).
Calibrating such a value on its whole range wastes the grid: in the PP-OCRv4 detector's stem a
conv output spans [-108.6, 90.4] while its hard-swish reader maps everything below -3 to 0.

``reader_bounds`` finds, in a graph with quantizers placed, the activation quantizers whose every
reader is such an op, and the hull of their readers' intervals; ``limit_observed_ranges`` gives
each quantizer its bounds (``Quantizer.observe_bounds``), so that calibration observes the value
clamped to them. The float function is unchanged: a value outside the bounds and its clamp give
the readers the same output (bounds that fall between grid points cost at most the step there).
Only calibration reads the bounds: the frozen scales and zero points are what is saved.

Opt-in (``Recipe.reader_bounds``, off in every preset): with it, the default preset's PP-OCRv4
recognizer (``quantize_onnx``, 32 / 64 lines, ORT node by node / fused) read 46.9% / 42.2% of the
lines exactly against 79.7% / 78.1% without it (the detector gains below). The loss comes with
bias correction: without it (``bias_correction=False``) the option raises the same recognizer
from 50.0% / 46.9% to 73.4% / 71.9%. Why the two conflict is not known yet (the one-pass
correction reads float layer inputs, which the bounds do not change).

Measured (``quantize_onnx``, 8 / 8 pages of 160 x 160, ONNX Runtime node by node / fused, mask
IoU and SQNR against float, every one of the 62 convs a QLinearConv in the fused session; load
8-16 on 2 cores, 2026-12-01): PP-OCRv4 det ``int8`` 0.948 / 0.943, 14.50 / 14.08 dB -> 0.962 /
0.954, 16.36 / 15.26 dB; the ``default`` preset 0.934 / 0.934, 13.21 / 13.25 dB -> 0.952 / 0.952,
14.94 / 14.97 dB (24 hard-swish inputs bounded; the stem's p2o.Conv.2 output grid step
0.63 -> 0.30 with mse, minmax range [-108.6, 90.4] -> [-3, 90.4]).
"""

from __future__ import annotations

import math

import torch

from ._fakequant import ConstantQuantizer, Quantizer
from ._record import CONTAINER

_aten = torch.ops.aten
LIMITED_METHODS = frozenset({"minmax"})  # calibration methods that get the bounds (see below)
INF = math.inf
_CLAMPS = {_aten.clamp.default, _aten.hardtanh.default}
_RELUS = {_aten.relu.default, _aten.relu_.default}
_HARDSWISH = {_aten.hardswish.default, _aten.hardswish_.default}
_ADDS = {_aten.add.Tensor, _aten.add.Scalar}
_MULS = {_aten.mul.Tensor}


def _scalar(gm: torch.fx.GraphModule, arg) -> float | None:
    """The value of a scalar constant argument (a literal, a one-element buffer, or either read
    through its constant quantizer), else None."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    if not isinstance(arg, torch.fx.Node):
        return None
    if arg.op == "call_module" and isinstance(gm.get_submodule(arg.target), ConstantQuantizer):
        return _scalar(gm, arg.args[0]) if arg.args else None
    if arg.op == "get_attr":
        value = gm
        for part in str(arg.target).split("."):
            value = getattr(value, part, None)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value.reshape(()))
    return None


def _clamp_outputs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node`` and the activation quantizer calls that read it (the same value on a grid)."""
    return [node] + [
        u
        for u in node.users
        if u.op == "call_module" and type(gm.get_submodule(u.target)) is Quantizer
    ]


def _clamp_interval(gm, node: torch.fx.Node) -> tuple[float, float] | None:
    """[lo, hi] outside which ``node`` (a reader of its first argument) is constant."""
    if node.target in _RELUS:
        return 0.0, INF
    if node.target in _HARDSWISH:
        return -3.0, INF
    if node.target in _CLAMPS:
        lo = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
        hi = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
        if node.target is _aten.hardtanh.default:  # defaults -1, 1
            lo = -1.0 if lo is None else lo
            hi = 1.0 if hi is None else hi
        lo_v = -INF if lo is None else _scalar(gm, lo)
        hi_v = INF if hi is None else _scalar(gm, hi)
        if lo_v is None or hi_v is None or lo_v > hi_v:
            return None
        return lo_v, hi_v
    return None


def _gate(gm, x: torch.fx.Node, add: torch.fx.Node) -> tuple[torch.fx.Node, float] | None:
    """For ``add = x + c`` read only by ``clamp(add, 0, ...)``: (the clamp, -c), the value of x
    below which the clamp is 0."""
    if add.target not in _ADDS or len(add.args) < 2 or add.kwargs.get("alpha", 1) != 1:
        return None
    a, b = add.args[0], add.args[1]
    c = _scalar(gm, b) if a is x else _scalar(gm, a) if b is x else None
    users = list(add.users)
    if c is None or len(users) != 1 or users[0].op != "call_function":
        return None
    interval = _clamp_interval(gm, users[0])
    if interval is None or interval[0] != 0.0:
        return None
    return users[0], -c


def _bounds(gm: torch.fx.GraphModule, x: torch.fx.Node) -> tuple[float, float] | None:
    """The hull of the intervals of ``x``'s readers, or None when a reader uses all of x."""
    readers = list(x.users)
    if not readers or any(r.op != "call_function" for r in readers):
        return None
    gates, gate_adds = {}, set()  # clamp node (0 below the floor) -> floor, from x + c readers
    for r in readers:
        if r.target in _ADDS and (gate := _gate(gm, x, r)) is not None:
            gates[gate[0]] = gate[1]
            gate_adds.add(r)
    lo, hi, used = INF, -INF, set()
    for r in readers:
        if r in gate_adds:
            continue  # an x + c gate: judged through the product it gates
        if r.target in _MULS and len(r.args) == 2 and x in r.args:
            other = r.args[1] if r.args[0] is x else r.args[0]
            hit = [
                clamp
                for clamp in gates
                if isinstance(other, torch.fx.Node) and other in _clamp_outputs(gm, clamp)
            ]
            if not hit:
                return None
            used.add(hit[0])
            interval = (gates[hit[0]], INF)  # x * clamp(x + c, 0, ...) is 0 wherever x <= -c
        elif r.args and r.args[0] is x and x not in r.args[1:]:
            interval = _clamp_interval(gm, r)
            if interval is None:
                return None
        else:
            return None
        lo, hi = min(lo, interval[0]), max(hi, interval[1])
    if used != set(gates) or lo > hi or (lo == -INF and hi == INF):
        return None  # a gate no product of x reads: x + c is read in full
    return lo, hi


def reader_bounds(gm: torch.fx.GraphModule) -> dict[str, tuple[float, float]]:
    """Activation quantizer attribute -> (lo, hi), for each whose value's readers are all constant
    outside [lo, hi] (``lo`` may be -inf, ``hi`` inf; never both)."""
    sites: dict[str, list[tuple[float, float] | None]] = {}
    prefix = CONTAINER + "."
    for node in gm.graph.nodes:
        if node.op != "call_module" or not str(node.target).startswith(prefix):
            continue
        module = gm.get_submodule(node.target)
        if type(module) is Quantizer and module.kind == "activation":
            sites.setdefault(str(node.target)[len(prefix) :], []).append(_bounds(gm, node))
    found = {}  # a quantizer called at several sites (a shared grid): the hull of all of them
    for attr, bounds in sites.items():
        if all(b is not None for b in bounds):
            lo, hi = min(b[0] for b in bounds), max(b[1] for b in bounds)
            if lo > -INF or hi < INF:
                found[attr] = (lo, hi)
    return found


def limit_observed_ranges(
    gm: torch.fx.GraphModule, every_method: bool = False
) -> dict[str, tuple[float, float]]:
    """Give each minmax-calibrated quantizer (``every_method``: each one) ``reader_bounds``
    finds its bounds; return them.

    Minmax only by default (``LIMITED_METHODS``, ``Recipe.reader_bounds=True``), by measurement:
    the methods that search a clipping range (mse, percentile, entropy) already leave the far tail
    out. PP-OCRv4 det with mse + 7-bit weights + fold_affine: 16.90 -> 16.82 dB node by node
    (unchanged); cls with mse + 7-bit weights: 127 -> 126 of 128 lines same as float (125 fused),
    against minmax's det gains (module docstring of ``_reader_ranges``).

    ``every_method`` (``Recipe.reader_bounds="all"``): an mse search does not leave out a wide
    tail that is not rare. The detector's split-ranges row (issue 14; 8-bit weights, equalize,
    fold_affine, mse, split_ranges) keeps [-35.8, 26.7] for the stem's p2o.Conv.1 output, all of
    it read only by a hard-swish that is 0 below -3, and bounds 26-27 such values when every method
    gets them. Torch fake-quant, 16 bench evaluation images / 8 other rendered images / the 8
    calibration images, calibration repeats 0 / 1 / 2 (2026-12-02): with sequential bias
    correction 18.92 / 18.17 / 17.77 -> 18.69 / 18.12 / 18.04 dB on the evaluation images (other
    images 19.00 / 19.56 / 19.50 -> 19.44 / 18.74 / 18.14; the calibration images themselves
    17.75 / 17.66 / 17.29 -> 19.07 / 18.83 / 18.38): no held-out gain; without bias correction
    the other images 17.49 / 18.63 / 15.13 -> 17.68 / 18.94 / 18.50."""
    container = gm.get_submodule(CONTAINER)
    found = {
        attr: bounds
        for attr, bounds in reader_bounds(gm).items()
        if every_method or getattr(container, attr).recipe.method in LIMITED_METHODS
    }
    for attr, bounds in found.items():
        getattr(container, attr).observe_bounds = bounds
    return found


__all__ = ["limit_observed_ranges", "reader_bounds"]
