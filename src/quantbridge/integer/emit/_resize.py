"""C99 and integer ONNX for the ``resize_linear`` and ``resize_cubic`` steps
(``kernels._pool``): the same int64 sums of the neighbours' centered codes along each resized
axis (linear: weights ``2**F - w1`` and ``w1``; cubic: four taps and weights per output
position), and one ``qb_requantize`` / ``requantize``."""

from __future__ import annotations

import numpy as np

from ._c import _Ctx, _requant
from ._c import _register as _register_c
from ._onnx import _Graph
from ._onnx import _register as _register_onnx


@_register_c("resize_linear")
def _resize_linear_c(c: _Ctx, k: str, step) -> str:
    a = step.attrs
    xs, ys = c.shapes[step.inputs[0]], c.shapes[step.output]
    one = 1 << a["frac"]
    resized = {axis: j for j, (axis, *_) in enumerate(a["axes"])}
    for j, (_, i0, i1, w1) in enumerate(a["axes"]):
        c.const("int32_t", f"{k}_i0_{j}", np.asarray(i0))
        c.const("int32_t", f"{k}_i1_{j}", np.asarray(i1))
        c.const("int64_t", f"{k}_w_{j}", np.asarray(w1))
    decompose = "".join(
        f"        const int o{d} = rem % {ys[d]}; rem /= {ys[d]};\n"
        for d in range(len(ys) - 1, -1, -1)
    )
    src, weight = "0", "(int64_t)1"
    for d in range(len(xs)):
        if d in resized:
            j = resized[d]
            bit = f"((corner >> {j}) & 1)"
            index = f"({bit} ? {k}_i1_{j}[o{d}] : {k}_i0_{j}[o{d}])"
            weight += f" * ({bit} ? {k}_w_{j}[o{d}] : {one}LL - {k}_w_{j}[o{d}])"
        else:
            index = f"o{d}"
        src = f"({src}) * {xs[d]} + {index}"
    x, y = c.names[step.inputs[0]], c.names[step.output]
    req = _requant(a, f"{a['multiplier']}LL", str(a["shift"])).format(acc="acc")
    return f"""    for (int i = 0; i < {c.size(step.output)}; i++) {{
        int rem = i;
{decompose}        int64_t acc = 0;
        for (int corner = 0; corner < {1 << len(a["axes"])}; corner++)
            acc += ({weight}) * ((int64_t){x}[{src}] - {a["x_zero"]});
        {y}[i] = ({c.ctype(step.output)}){req};
    }}
"""


@_register_onnx("resize_linear")
def _resize_linear_onnx(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    rank = len(g.shapes[step.inputs[0]])
    acc = g.centered(ins[0], a["x_zero"])
    one = 1 << a["frac"]
    for axis, i0, i1, w1 in a["axes"]:
        shape = [1] * rank
        shape[axis] = -1
        w = np.asarray(w1, np.int64).reshape(shape)
        low = g.op("Mul", [g.op("Gather", [acc, g.const(i0)], axis=axis), g.const(one - w)])
        high = g.op("Mul", [g.op("Gather", [acc, g.const(i1)], axis=axis), g.const(w)])
        acc = g.op("Add", [low, high])
    g.requantize(acc, step, a["multiplier"], a["shift"], (), out)


@_register_c("resize_cubic")
def _resize_cubic_c(c: _Ctx, k: str, step) -> str:
    a = step.attrs
    xs, ys = c.shapes[step.inputs[0]], c.shapes[step.output]
    resized = {axis: j for j, (axis, *_) in enumerate(a["axes"])}
    for j, (_, taps, weights) in enumerate(a["axes"]):
        c.const("int32_t", f"{k}_t_{j}", np.asarray(taps).reshape(-1))
        c.const("int64_t", f"{k}_w_{j}", np.asarray(weights).reshape(-1))
    decompose = "".join(
        f"        const int o{d} = rem % {ys[d]}; rem /= {ys[d]};\n"
        for d in range(len(ys) - 1, -1, -1)
    )
    src, weight = "0", "(int64_t)1"
    for d in range(len(xs)):
        if d in resized:  # tap (corner >> 2j) & 3 of output position o along axis j
            j = resized[d]
            at = f"o{d} * 4 + ((corner >> {2 * j}) & 3)"
            index, weight = f"{k}_t_{j}[{at}]", f"{weight} * {k}_w_{j}[{at}]"
        else:
            index = f"o{d}"
        src = f"({src}) * {xs[d]} + {index}"
    x, y = c.names[step.inputs[0]], c.names[step.output]
    req = _requant(a, f"{a['multiplier']}LL", str(a["shift"])).format(acc="acc")
    return f"""    for (int i = 0; i < {c.size(step.output)}; i++) {{
        int rem = i;
{decompose}        int64_t acc = 0;
        for (int corner = 0; corner < {4 ** len(a["axes"])}; corner++)
            acc += ({weight}) * ((int64_t){x}[{src}] - {a["x_zero"]});
        {y}[i] = ({c.ctype(step.output)}){req};
    }}
"""


@_register_onnx("resize_cubic")
def _resize_cubic_onnx(g: _Graph, step, ins: list[str], out: str) -> None:
    a = step.attrs
    rank = len(g.shapes[step.inputs[0]])
    acc = g.centered(ins[0], a["x_zero"])
    for axis, taps, weights in a["axes"]:
        shape = [1] * rank
        shape[axis] = -1
        taps, weights = np.asarray(taps, np.int64), np.asarray(weights, np.int64)
        terms = [
            g.op(
                "Mul",
                [
                    g.op("Gather", [acc, g.const(taps[:, t])], axis=axis),
                    g.const(weights[:, t].reshape(shape)),
                ],
            )  # fmt: skip
            for t in range(taps.shape[1])
        ]
        acc = terms[0]
        for term in terms[1:]:  # (ONNX Sum is float only)
            acc = g.op("Add", [acc, term])
    g.requantize(acc, step, a["multiplier"], a["shift"], (), out)
