"""The one accuracy table of ``BENCHMARKS.md`` (issue 14, "Done when"): per workload and peer,
ours' default and ours' best (which row), the peer's default and the peer's best (which row), and
the signed differences ``ours - peer`` default vs default and best vs best, median [min..max] of
the per-repeat differences when rows hold several calibration repeats.

Which rows are compared, and when a comparison does not count (a failed peer, a file that is not
INT8), is ``verdicts.compare``'s decision; this module lays it out, so the table and the
verdicts of the Targets table cannot disagree. Nothing is measured here.
"""

from __future__ import annotations

from . import verdicts

HEADER = [
    "| workload (metric) | ours default | ours best (row) | peer | peer default | peer best (row) "
    "| ours - peer, default vs default | ours - peer, best vs best |",
    "|---|---|---|---|---|---|---|---|",
]
REASON_CHARS = 110  # a failure's reason in a cell


def value(row: dict, key: str) -> str:
    """``median [min-max]`` of the row's repeats in the metric's units (one value: no range)."""
    scale, unit, digits = verdicts.UNITS.get(key, (1, " dB", 2))
    unit = " %" if unit == " points" else unit
    values = row.get("values") or [verdicts.row_value(row, key)]
    text = f"{scale * verdicts.row_value(row, key):.{digits}f}{unit}"
    if len(values) > 1:
        text += f" [{scale * min(values):.{digits}f}-{scale * max(values):.{digits}f}]"
    return text


def row_cell(row: dict | None, key: str, named: bool) -> str:
    """A chosen row: its value (and configuration when ``named``), or ``failed: <reason>``, or
    its value marked ``not INT8``; and its layout where it is not every activation quantized
    (``verdicts.layout``)."""
    if row is None:
        return "not run"
    if "error" in row:
        return f"failed: {row['error'][:REASON_CHARS]}"
    if "not_applicable" in row:
        return f"not run: {row['not_applicable']}"
    text = value(row, key) + (f" ({row['config']})" if named else "")
    why = verdicts.not_int8(row)
    text = f"{text}; {why}" if why else text
    layout = verdicts.layout(row)  # a file that leaves its residual sums float says so
    return f"{text}; {layout}" if layout else text


def difference_cell(c: dict, key: str) -> str:
    """``+0.12 dB [-0.03..+0.20]`` for a counted comparison, **bold** when ours is behind;
    otherwise ``not compared (<why>)``: peer failed, peer not INT8, ours failed ..."""
    if "delta" not in c:  # the reason's details are in the row's own cell
        return f"not compared ({c['status'].split(':')[0]})"
    text = verdicts.signed(key, c["delta"])
    return f"**{text} behind**" if c["status"] == "behind" else text


def best_cell(c: dict, key: str) -> str:
    """The peer's best INT8 row, or (none) why: every row failed, or none is INT8."""
    if c["peer_row"] is not None:
        return row_cell(c["peer_row"], key, named=True)
    status = c["status"].removeprefix("peer ")
    return status if status.startswith("failed") else f"no INT8 row ({status})"


def workload_rows(title: str, acc: dict, key: str) -> list[str]:
    """One table row per peer of one workload; ours' cells on the first row only."""
    per_peer: dict[str, dict[str, dict]] = {}
    for c in verdicts.compare(acc, key):
        per_peer.setdefault(c["peer"], {})[c["kind"]] = c
    default, best = verdicts.ours_rows(acc, key)
    ours = [row_cell(default, key, named=False), row_cell(best, key, named=True)]
    out = []
    for i, (peer, kinds) in enumerate(per_peer.items()):
        d, b = kinds["default"], kinds["best"]
        lead = [title, *ours] if i == 0 else ["", "", ""]
        cells = [*lead, peer, row_cell(d["peer_row"], key, named=False), best_cell(b, key),
                 difference_cell(d, key), difference_cell(b, key)]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    return out


def table(results: dict, metric_names: dict[str, str]) -> list[str]:
    """The whole table over every workload with accuracy rows (empty when there is none)."""
    body = []
    for name, entry in results["workloads"].items():
        acc = entry.get("accuracy")
        if not acc or "config" not in (acc["rows"] or [{}])[0]:
            continue
        key = verdicts.primary(acc["metric"])
        floor = acc.get("constant_sqnr_db")  # what an input-blind output scores (accuracy)
        floor = f"; an output ignoring the input: {floor:.2f} dB" if floor is not None else ""
        body += workload_rows(f"{name} ({metric_names.get(key, key)}{floor})", acc, key)
    return [*HEADER, *body, ""] if body else []
