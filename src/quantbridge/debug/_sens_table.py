"""The terminal table of a sensitivity result (rich): the most sensitive layers, the baselines
and the repair."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def sensitivity_table(result: dict[str, Any], n: int = 15) -> Table:
    """A rich ``Table`` of the ``n`` most sensitive layers of ``result`` (a ``to_json()`` dict)."""
    metric = result["metric"]
    base = result["baseline"]
    table = Table(
        title=f"layer sensitivity ({metric}): float {_f(base['float'])}, "
        f"all quantized {_f(base['quantized'])}",
    )
    for head in ("rank", "layer", "op", "all but this quantized", "only this quantized", "repair"):
        # a layer name is what the user copies into a rule: wrapped whole, never cut with "…"
        table.add_column(
            head,
            justify="right" if head == "rank" else "left",
            overflow="fold" if head in ("layer", "repair") else "ellipsis",
        )
    kept = set(result.get("keep_float") or [])
    wider = result.get("wider") or {}
    for row in sorted(result["layers"], key=lambda r: r["rank"])[:n]:
        name = row["name"]
        repair = "float" if name in kept else wider.get(name, "") or row.get("note", "")
        table.add_row(
            str(row["rank"]),
            name or "(top level)",
            row["op"],
            _f(row["all_but_this_quantized"]),
            _f(row["only_this_quantized"]),
            repair,
        )
    if result.get("budget") is not None:
        table.caption = (
            f"budget {result['budget']}: {len(kept)} float, {len(wider)} wider; "
            f"achieved {_f(result.get('achieved'))} (verified by re-quantizing)"
        )
    return table


def print_sensitivity(result: dict[str, Any], n: int = 15, console: Console | None = None) -> None:
    (console or Console()).print(sensitivity_table(result, n))


def _f(value) -> str:
    return "inf" if value is None else f"{value:.6g}"
