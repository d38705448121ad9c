"""C99 for the ``softmax`` and ``layernorm`` steps (``kernels._normalize`` states the pipelines),
registered in the C emitter's table. Same integer operations as the numpy kernels: flooring
division (``qb_round_div``), Newton's integer square root with the same start and step count
(``qb_isqrt``), ``qb_requantize``; int32 softmax sums, int64 elsewhere."""

from __future__ import annotations

import numpy as np

from ...numerics._intmath import ISQRT_STEPS
from ..kernels._normalize import SOFTMAX_OUT_BITS
from ._c import _Ctx, _register, _requant

HELPERS = f"""/* numerics.round_divide: floor((2a + b) / (2b)), b > 0: to nearest, ties up */
static inline int64_t qb_round_div(int64_t a, int64_t b) {{
    const int64_t n = 2 * a + b, d = 2 * b, q = n / d;
    return q - (n % d < 0);
}}
/* numerics.isqrt_newton: floor(sqrt(w)), 1 <= w < 2**62 */
static inline int64_t qb_isqrt(int64_t w) {{
    int c = 0;
    for (int j = 0; j < 32; j++) c += w >= ((int64_t)1 << (2 * j));
    int64_t x = (int64_t)1 << c;
    for (int i = 0; i < {ISQRT_STEPS}; i++) {{
        const int64_t y = (x + w / x) / 2;
        if (y < x) x = y;
    }}
    return x;
}}
"""


def _helpers(c: _Ctx) -> None:
    if HELPERS not in c.decls:
        c.decls.insert(0, HELPERS)


@_register("softmax")
def _softmax(c: _Ctx, k: str, step) -> str:
    _helpers(c)
    shape = c.shapes[step.inputs[0]]
    n = shape[-1]
    rows = c.size(step.inputs[0]) // n
    c.const("int32_t", f"{k}_t", step.attrs["table"])
    c.decls.append(f"static int32_t {k}_e[{n}];")
    x, y = c.names[step.inputs[0]], c.names[step.output]
    top = 2**SOFTMAX_OUT_BITS - 1
    last = len(step.attrs["table"]) - 1
    if len(step.inputs) > 1:
        return _masked_softmax(c, k, step, rows, n, last)
    return f"""    for (int r = 0; r < {rows}; r++) {{
        const {c.ctype(step.inputs[0])} *xr = {x} + r * {n};
        int32_t mx = xr[0];
        int64_t sum = 0;
        for (int j = 1; j < {n}; j++) if (xr[j] > mx) mx = xr[j];
        for (int j = 0; j < {n}; j++) {{
            const int32_t d = mx - xr[j];
            {k}_e[j] = {k}_t[d < {last} ? d : {last}];
            sum += {k}_e[j];
        }}
        for (int j = 0; j < {n}; j++) {{
            const int64_t p = qb_round_div((int64_t){k}_e[j] << {SOFTMAX_OUT_BITS}, sum);
            {y}[r * {n} + j] = (int16_t)(p > {top} ? {top} : p);
        }}
    }}
"""


def _masked_softmax(c: _Ctx, k: str, step, rows: int, n: int, last: int) -> str:
    """``kernels._normalize._masked_softmax``: masked scores weigh 0, the maximum runs over the
    kept ones, a row with none kept is uniform; the mask read through its broadcast map."""
    shape = c.shapes[step.inputs[0]]
    mask = step.inputs[1]
    index = np.broadcast_to(np.arange(c.size(mask)).reshape(c.shapes[mask]), shape)
    c.const("int32_t", f"{k}_k", index)
    x, y, keep = c.names[step.inputs[0]], c.names[step.output], c.names[mask]
    top = 2**SOFTMAX_OUT_BITS - 1
    return f"""    for (int r = 0; r < {rows}; r++) {{
        const {c.ctype(step.inputs[0])} *xr = {x} + r * {n};
        const int32_t *kr = {k}_k + r * {n};
        int32_t mx = 0, kept = 0;
        int64_t sum = 0;
        for (int j = 0; j < {n}; j++)
            if ({keep}[kr[j]] && (!kept || xr[j] > mx)) {{ mx = xr[j]; kept = 1; }}
        for (int j = 0; j < {n}; j++) {{
            const int32_t d = mx - xr[j];
            {k}_e[j] = !kept ? {k}_t[0] : !{keep}[kr[j]] ? 0 : {k}_t[d < {last} ? d : {last}];
            sum += {k}_e[j];
        }}
        for (int j = 0; j < {n}; j++) {{
            const int64_t p = qb_round_div((int64_t){k}_e[j] << {SOFTMAX_OUT_BITS}, sum);
            {y}[r * {n} + j] = (int16_t)(p > {top} ? {top} : p);
        }}
    }}
"""


@_register("layernorm")
def _layernorm(c: _Ctx, k: str, step) -> str:
    _helpers(c)
    a = step.attrs
    n = a["n"]
    rows = c.size(step.inputs[0]) // n
    c.const("int64_t", f"{k}_m", np.asarray(a["multipliers"], np.int64))
    c.const("int64_t", f"{k}_b", np.asarray(a["offsets"], np.int64))
    x, y = c.names[step.inputs[0]], c.names[step.output]
    req = _requant(a, "1", str(a["shift"])).format(acc="acc")
    period = np.size(a["multipliers"]) // n  # rows before the affine repeats (a group norm)
    j = "i" if period == 1 else f"(r % {period}) * {n} + i"
    return f"""    for (int r = 0; r < {rows}; r++) {{
        const {c.ctype(step.inputs[0])} *xr = {x} + r * {n};
        int64_t s1 = 0, s2 = 0;
        for (int i = 0; i < {n}; i++) {{
            const int64_t v = (int64_t)xr[i] - {a["x_zero"]};
            s1 += v;
            s2 += v * v;
        }}
        const int64_t w = ({n}LL * s2 - s1 * s1) * ((int64_t)1 << {2 * a["k"]}) + {a["eps"]}LL;
        const int64_t root = qb_isqrt(w);
        for (int i = 0; i < {n}; i++) {{
            const int64_t d = {n}LL * ((int64_t)xr[i] - {a["x_zero"]}) - s1;
            const int64_t t = qb_round_div(d * ((int64_t)1 << {a["k"] + a["frac"]}), root);
            const int64_t acc = t * {k}_m[{j}] + {k}_b[{j}];
            {y}[r * {n} + i] = ({c.ctype(step.output)}){req};
        }}
    }}
"""


@_register("row_squares")
def _row_squares(c: _Ctx, k: str, step) -> str:
    """``base + sign * #{thresholds <= S2}`` per row (``lowering._rms``)."""
    a = step.attrs
    n = c.shapes[step.inputs[0]][-1]
    rows = c.size(step.inputs[0]) // n
    thresholds = np.asarray(a["thresholds"], np.int64)
    c.const("int64_t", f"{k}_t", thresholds if thresholds.size else np.zeros(1, np.int64))
    x, y = c.names[step.inputs[0]], c.names[step.output]
    return f"""    for (int r = 0; r < {rows}; r++) {{
        int64_t s2 = 0, s1 = 0;
        for (int i = 0; i < {n}; i++) {{
            const int64_t v = (int64_t){x}[r * {n} + i] - {a["x_zero"]};
            s2 += v * v;
            s1 += v;
        }}
        {"s2 = " + str(n) + " * s2 - s1 * s1;" if a.get("centered", False) else "(void)s1;"}
        int count = 0;
        for (int j = 0; j < {thresholds.size}; j++) count += {k}_t[j] <= s2;
        {y}[r] = ({c.ctype(step.output)})({a["base"]} + {a["sign"]} * count);
    }}
"""
