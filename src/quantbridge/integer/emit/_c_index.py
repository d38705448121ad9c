"""C99 for the integer / bool steps of ``kernels._index`` (masks, ids, table lookups), registered
in the C emitter's table: one loop over the output, inputs broadcast through index maps."""

from __future__ import annotations

import numpy as np

from ._c import _broadcast_index, _Ctx, _register

C_LOGIC = {"And": "&&", "Or": "||", "Xor": "!="}
C_COMPARE = {"Equal": "==", "Less": "<", "LessOrEqual": "<=", "Greater": ">",
             "GreaterOrEqual": ">="}  # fmt: skip


def _loop(c: _Ctx, k: str, step, expression) -> str:
    out = step.output
    xs = [_broadcast_index(c, k, i, t, c.shapes[out]) for i, t in enumerate(step.inputs)]
    return (f"    for (int i = 0; i < {c.size(out)}; i++) "
            f"{c.names[out]}[i] = ({c.ctype(out)})({expression(xs)});\n")  # fmt: skip


@_register("logic")
def _logic(c: _Ctx, k: str, step) -> str:
    op = step.attrs["fn"]
    if op == "Not":
        return _loop(c, k, step, lambda x: f"!{x[0]}")
    return _loop(c, k, step, lambda x: f"({x[0]} != 0) {C_LOGIC[op]} ({x[1]} != 0)")


@_register("compare")
def _compare(c: _Ctx, k: str, step) -> str:
    op = C_COMPARE[step.attrs["fn"]]
    return _loop(c, k, step, lambda x: f"(int64_t){x[0]} {op} (int64_t){x[1]}")


@_register("where")
def _where(c: _Ctx, k: str, step) -> str:
    return _loop(c, k, step, lambda x: f"{x[0]} ? {x[1]} : {x[2]}")


@_register("cast")
def _cast(c: _Ctx, k: str, step) -> str:
    if step.attrs["logical"]:
        return _loop(c, k, step, lambda x: f"{x[0]} != 0")
    return _loop(c, k, step, lambda x: x[0])


def _around(shape, axis: int) -> tuple[int, int, int]:
    axis %= len(shape)
    return int(np.prod(shape[:axis])), shape[axis], int(np.prod(shape[axis + 1 :]))


@_register("cumsum")
def _cumsum(c: _Ctx, k: str, step) -> str:
    a = step.attrs
    outer, n, inner = _around(c.shapes[step.inputs[0]], a["axis"])
    x, y, t = c.names[step.inputs[0]], c.names[step.output], c.ctype(step.output)
    j = f"{n - 1} - j" if a["reverse"] else "j"
    at = f"(o * {n} + ({j})) * {inner} + i"
    add = (f"{y}[{at}] = sum; sum += {x}[{at}];" if a["exclusive"]
           else f"sum += {x}[{at}]; {y}[{at}] = sum;")  # fmt: skip
    return f"""    for (int o = 0; o < {outer}; o++) for (int i = 0; i < {inner}; i++) {{
        {t} sum = 0;
        for (int j = 0; j < {n}; j++) {{ {add} }}
    }}
"""


@_register("take")
def _take(c: _Ctx, k: str, step) -> str:
    data, indices = step.inputs
    outer, n, inner = _around(c.shapes[data], step.attrs["axis"])
    count = c.size(indices)
    x, idx, y = c.names[data], c.names[indices], c.names[step.output]
    return f"""    for (int o = 0; o < {outer}; o++) for (int j = 0; j < {count}; j++) {{
        int64_t r = (int64_t){idx}[j];
        if (r < 0) r += {n};
        for (int i = 0; i < {inner}; i++)
            {y}[(o * {count} + j) * {inner} + i] = {x}[(o * {n} + r) * {inner} + i];
    }}
"""


@_register("arith")
def _arith(c: _Ctx, k: str, step) -> str:
    """In the output type; wider than int32 in int64 (C wraps unsigned only: int64 ids stay
    far from overflow)."""
    op = {"Add": "+", "Sub": "-", "Mul": "*"}[step.attrs["fn"]]
    t = c.ctype(step.output)
    return _loop(c, k, step, lambda x: f"({t}){x[0]} {op} ({t}){x[1]}")


@_register("arg_extreme")
def _arg_extreme(c: _Ctx, k: str, step) -> str:
    a, shape = step.attrs, c.shapes[step.inputs[0]]
    axis = a["axis"] % len(shape)
    outer, n = int(np.prod(shape[:axis], dtype=np.int64)), shape[axis]
    inner = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    better = (">" if a["fn"] == "ArgMax" else "<") + ("=" if a["last"] else "")
    x, y = c.names[step.inputs[0]], c.names[step.output]
    return f"""    for (int o = 0; o < {outer}; o++) for (int i = 0; i < {inner}; i++) {{
        int64_t best = (int64_t){x}[o * {n * inner} + i], at = 0;
        for (int j = 1; j < {n}; j++) {{
            const int64_t v = (int64_t){x}[(o * {n} + j) * {inner} + i];
            if (v {better} best) {{ best = v; at = j; }}
        }}
        {y}[o * {inner} + i] = at;
    }}
"""


@_register("int_concat")
def _int_concat(c: _Ctx, k: str, step) -> str:
    out = step.output
    outer, total, inner = _around(c.shapes[out], step.attrs["axis"])
    y, code, offset = c.names[out], [], 0
    for t in step.inputs:
        n = c.shapes[t][step.attrs["axis"] % len(c.shapes[t])]
        code.append(f"""    for (int o = 0; o < {outer}; o++) for (int i = 0; i < {n * inner}; i++)
        {y}[o * {total * inner} + {offset * inner} + i] = ({c.ctype(out)}){c.names[t]}[o * {n * inner} + i];
""")  # fmt: skip
        offset += n
    return "".join(code)


@_register("take_nd")
def _take_nd(c: _Ctx, k: str, step) -> str:
    data, indices = step.inputs
    shape, ishape = c.shapes[data], c.shapes[indices]
    m = ishape[-1]
    inner = int(np.prod(shape[m:], dtype=np.int64))
    x, idx, y = c.names[data], c.names[indices], c.names[step.output]
    offset = "".join(
        f"""        {{ int64_t r = (int64_t){idx}[j * {m} + {d}]; if (r < 0) r += {shape[d]};
          at = at * {shape[d]} + r; }}
"""
        for d in range(m)
    )
    return f"""    for (int j = 0; j < {c.size(indices) // m}; j++) {{
        int64_t at = 0;
{offset}        for (int i = 0; i < {inner}; i++) {y}[j * {inner} + i] = {x}[at * {inner} + i];
    }}
"""
