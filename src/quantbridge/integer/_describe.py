"""The fixed-point view of a program for ``quantbridge inspect --fixed-point``: each tensor's format
(``IntegerProgram.describe``) and each step's requantization, ``multiplier / 2**shift`` per output
channel (or per input of a rescaled sum), with the pure shifts of power-of-two scales named."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._program import IntegerProgram


def _values(attrs: dict[str, Any], key: str) -> np.ndarray | None:
    value = attrs.get(key)
    return None if value is None else np.atleast_1d(np.asarray(value, np.int64))


def requantizations(program: IntegerProgram) -> list[dict[str, Any]]:
    """One entry per step that rescales: node, op, output tensor, multipliers and shifts (as
    lists), and whether every rescale is a pure shift (multiplier a power of two)."""
    found = []
    for step in program.steps:
        attrs = dict(step.attrs)
        multipliers = _values(attrs, "multiplier")
        if multipliers is None:
            multipliers = _values(attrs, "multipliers")
        shifts = _values(attrs, "shift")
        if shifts is None:
            shifts = _values(attrs, "shifts")
        if multipliers is None or shifts is None:
            continue
        pure = bool(np.all((multipliers & (multipliers - 1)) == 0))
        found.append({
            "node": step.node, "op": step.op, "output": step.output,
            "multipliers": multipliers.tolist(), "shifts": shifts.tolist(), "shift_only": pure,
        })  # fmt: skip
    return found


def _short(values: list[int]) -> str:
    unique = sorted(set(values))
    if len(unique) == 1:
        return str(unique[0]) + (f" (x{len(values)})" if len(values) > 1 else "")
    return f"{len(values)} values in [{unique[0]}, {unique[-1]}]"


def describe_fixed_point(program: IntegerProgram) -> str:
    """``program.describe()`` and a table of every requantization (``requantizations``)."""
    rows = [("step", "op", "output", "multiplier", "shift", "form")]
    for r in requantizations(program):
        form = "shift only" if r["shift_only"] else "(acc * M) >> n"
        rows.append((r["node"], r["op"], r["output"], _short(r["multipliers"]),
                     _short(r["shifts"]), form))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]  # fmt: skip
    return "\n".join([program.describe(), "", f"requantizations: {len(rows) - 1}", *lines])
