"""C99 for the ``l2_normalize``, ``l2_norm`` and ``divide`` steps (``kernels._divide`` states the
pipelines), registered in the C emitter's table: int64 sums of squares per row (each element's
row from a constant index map, so any reduced axes work), ``qb_isqrt``, ``qb_div_even``
(``numerics.divide_half_even``) and ``qb_requantize``."""

from __future__ import annotations

import numpy as np

from ._c import _broadcast_index, _Ctx, _register, _requant
from ._c_normalize import _helpers

DIV_EVEN = """/* numerics.divide_half_even: a / b to nearest, ties to even, b > 0 */
static inline int64_t qb_div_even(int64_t a, int64_t b) {
    int64_t q = a / b, r = a % b;
    if (r < 0) { q -= 1; r += b; }
    return q + (2 * r > b || (2 * r == b && (q & 1)));
}
"""


def _rows(c: _Ctx, k: str, step) -> tuple[str, int]:
    """Each element's row (``{k}_row``) and the number of rows; ``{k}_r`` holds each row's R."""
    if DIV_EVEN not in c.decls:
        c.decls.insert(0, DIV_EVEN)
    _helpers(c)
    shape = c.shapes[step.inputs[0]]
    kept = tuple(1 if i in step.attrs["axes"] else d for i, d in enumerate(shape))
    rows = int(np.prod(kept))
    row = np.broadcast_to(np.arange(rows).reshape(kept), shape)
    c.const("int32_t", f"{k}_row", row)
    c.decls.append(f"static int64_t {k}_r[{rows}];")
    a, x = step.attrs, c.names[step.inputs[0]]
    code = f"""    for (int r = 0; r < {rows}; r++) {k}_r[r] = 0;
    for (int i = 0; i < {c.size(step.inputs[0])}; i++) {{
        const int64_t v = (int64_t){x}[i] - {a["x_zero"]};
        {k}_r[{k}_row[i]] += v * v;
    }}
    for (int r = 0; r < {rows}; r++)
        {k}_r[r] = {k}_r[r] == 0 ? 0 : qb_isqrt({k}_r[r] * ((int64_t)1 << {2 * a["k"]}));
"""
    return code, rows


@_register("l2_normalize")
def _l2_normalize(c: _Ctx, k: str, step) -> str:
    a, out = step.attrs, step.output
    code, _ = _rows(c, k, step)
    e = f"{a['eps']}LL"
    d = f"({k}_r[{k}_row[i]] > {e} ? {k}_r[{k}_row[i]] : {e})" if a["eps_mode"] == "max" else (
        f"({k}_r[{k}_row[i]] + {e})")  # fmt: skip
    body = f"""    for (int i = 0; i < {c.size(out)}; i++) {{
        int64_t d = {d};
        if (d < 1) d = 1;
        const int64_t num = ((int64_t){c.names[step.inputs[0]]}[i] - {a["x_zero"]}) * {a["multiplier"]}LL * ((int64_t)1 << {a["left"]});
        int64_t y = {a["out_zero"]} + qb_div_even(num, d * ((int64_t)1 << {a["right"]}));
        y = y < {a["qmin"]} ? {a["qmin"]} : y > {a["qmax"]} ? {a["qmax"]} : y;
        {c.names[out]}[i] = ({c.ctype(out)})y;
    }}
"""  # noqa: E501
    return code + body


@_register("l2_norm")
def _l2_norm(c: _Ctx, k: str, step) -> str:
    a, out = step.attrs, step.output
    code, rows = _rows(c, k, step)
    req = _requant(a, f"{a['multiplier']}LL", str(a["shift"])).format(acc=f"{k}_r[r]")
    body = f"    for (int r = 0; r < {rows}; r++) {c.names[out]}[r] = ({c.ctype(out)}){req};\n"
    return code + body


@_register("divide")
def _divide(c: _Ctx, k: str, step) -> str:
    if DIV_EVEN not in c.decls:
        c.decls.insert(0, DIV_EVEN)
    a, out = step.attrs, step.output
    xa, xd = (_broadcast_index(c, k, i, t, c.shapes[out]) for i, t in enumerate(step.inputs))
    return f"""    for (int i = 0; i < {c.size(out)}; i++) {{
        int64_t num = ((int64_t){xa} - {a["a_zero"]}) * {a["multiplier"]}LL * ((int64_t)1 << {a["left"]});
        int64_t den = ((int64_t){xd} - {a["d_zero"]}) * ((int64_t)1 << {a["right"]});
        if (den < 0) {{ num = -num; den = -den; }}
        int64_t y = den == 0 ? (num > 0 ? {a["qmax"]} : num < 0 ? {a["qmin"]} : {a["out_zero"]})
                             : {a["out_zero"]} + qb_div_even(num, den);
        y = y < {a["qmin"]} ? {a["qmin"]} : y > {a["qmax"]} ? {a["qmax"]} : y;
        {c.names[out]}[i] = ({c.ctype(out)})y;
    }}
"""  # noqa: E501
