"""``CompareResult``: the table ``compare`` returns, with the JSON of ``quantbridge.compare/1``
(the contract the HTML report reads), a dataframe, the worst tensors and a text table."""

from __future__ import annotations

from typing import Any

SCHEMA = "quantbridge.compare/1"


# worst first: engines that disagree, then what quantization costs, then benign ties
_CLASS_RANK = {"divergence": 3, "quantization noise": 2, "rounding": 1, "exact": 0}


def _badness(pair: dict[str, Any]) -> tuple[int, float, float]:
    """Sort key, worst first: the class, steps of error (where the tensor has a scale), then
    low SQNR."""
    lsb = pair.get("max_lsb")
    sqnr = pair["sqnr_db"]
    return (
        _CLASS_RANK[pair["class"]],
        lsb if lsb is not None else -1.0,
        -sqnr if sqnr is not None else -1e9,
    )


def _output_lines(tensors: list[dict[str, Any]]) -> list[str]:
    """One line per model output: how far each engine is from the reference there (what the
    user sees at the end, however the differences above were classed)."""
    lines = []
    for t in tensors:
        if not t.get("output") or not t["pairs"]:
            continue
        parts = []
        for p in t["pairs"]:
            if p["class"] == "exact":
                parts.append(f"{p['b']} vs {p['a']} identical")
                continue
            sqnr = "-" if p["sqnr_db"] is None else f"{p['sqnr_db']:.1f} dB"
            lsb = "" if p.get("max_lsb") is None else f", max {p['max_lsb']:.2f} LSB"
            parts.append(f"{p['b']} vs {p['a']} SQNR {sqnr}{lsb} ({p['class']})")
        name = t["output"] if t["output"] == t["name"] else f"{t['output']} (tensor {t['name']})"
        lines.append(f"model output {name}: " + "; ".join(parts))
    return lines


def _pairing_lines(tensors: list[dict[str, Any]]) -> list[str]:
    """One line per run on a float file: how its tensors were paired with the sites."""
    rules: dict[str, dict[str, int]] = {}
    for t in tensors:
        for p in t["pairs"]:
            if "float_tensor" in p:
                count = rules.setdefault(p["b"], {})
                count[p["matched_by"]] = count.get(p["matched_by"], 0) + 1
    return [
        f"{run}: {sum(c.values())} tensors paired with the float file's ("
        + "; ".join(f"{n} by {rule}" for rule, n in c.items())
        + ")"
        for run, c in rules.items()
    ]


def describe_tensor(name: str, tensors: list[dict[str, Any]]) -> str:
    """``name`` with the op that computes it and its layer, e.g. ``val_4 (MaxPool
    node_max_pool2d)``: the file's tensor names (``val_3``) alone do not say what they are."""
    t = next((t for t in tensors if t["name"] == name), None)
    if t is None:
        return name
    what = t["op"] if t["op"] != "input" else "input"
    layer = t["layer"] if t["layer"] and t["layer"] != name else ""
    return f"{name} ({what}{' ' + layer if layer else ''})"


class CompareResult:
    """Per-tensor metrics of every engine against the reference engine (``compare``)."""

    def __init__(self, data: dict[str, Any]):
        self._data = data

    def to_json(self) -> dict[str, Any]:
        """The ``quantbridge.compare/1`` dict (see docs/debugging.md), plain JSON data."""
        return self._data

    @property
    def tensors(self) -> list[dict[str, Any]]:
        return self._data["tensors"]

    @property
    def errors(self) -> dict[str, str]:
        return self._data["errors"]

    @property
    def unmatched(self) -> dict[str, list[str]]:
        return self._data["unmatched"]

    @property
    def first_divergence(self) -> dict[str, Any] | None:
        """The first tensor in topological order classified "divergence" (the bisection), as
        ``{"name", "order", "layer", "a", "b", "max_lsb"}``, or None."""
        return self._data["first_divergence"]

    def rows(self) -> list[dict[str, Any]]:
        """One flat row per tensor and engine pair, in topological order."""
        rows = []
        for t in self.tensors:
            for p in t["pairs"]:
                share = p.get("lsb_share") or {}
                rows.append({
                    "order": t["order"], "name": t["name"], "layer": t["layer"], "op": t["op"],
                    "scale": t["scale"], "a": p["a"], "b": p["b"], "class": p["class"],
                    "sqnr_db": p["sqnr_db"], "cosine": p["cosine"], "max_abs": p["max_abs"],
                    "mean_abs": p["mean_abs"], "max_lsb": p.get("max_lsb"),
                    "carried_lsb": p.get("carried_lsb"), "matched_by": p.get("matched_by"),
                    **{f"lsb_{k}": v for k, v in share.items()},
                })  # fmt: skip
        return rows

    def worst(self, n: int = 10) -> list[dict[str, Any]]:
        """The ``n`` worst (tensor, engine pair) rows: divergences first, then quantization
        noise, rounding and exact pairs; most steps of error first within a class."""
        return sorted(self.rows(), key=_badness, reverse=True)[:n]

    def to_dataframe(self):
        """The rows as a pandas DataFrame (ImportError when pandas is not installed)."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError(
                "CompareResult.to_dataframe needs pandas: pip install pandas (or use .rows() / "
                ".to_json(), which need nothing)"
            ) from e
        return pd.DataFrame(self.rows())

    def table(self, n: int = 10) -> list[list[str]]:
        """Header and the ``n`` worst rows as strings (``__str__`` and ``__rich__`` show it)."""
        head = ["#", "tensor", "layer", "a", "b", "class", "max LSB", "carried LSB",
                "share >1 LSB", "SQNR dB"]  # fmt: skip
        body = []
        for r in self.worst(n):
            over = (r.get("lsb_2") or 0.0) + (r.get("lsb_>2") or 0.0)
            carried = r.get("carried_lsb")
            body.append([
                str(r["order"]), r["name"], r["layer"], r["a"], r["b"], r["class"],
                "-" if r["max_lsb"] is None else f"{r['max_lsb']:.2f}",
                "-" if not carried else f"{carried:.2f}",
                "-" if r["max_lsb"] is None else f"{100 * over:.2f}%",
                "-" if r["sqnr_db"] is None else f"{r['sqnr_db']:.1f}",
            ])  # fmt: skip
        return [head, *body]

    def summary(self) -> list[str]:
        """Lines under the table: reference, first divergence, errors, unmatched tensors."""
        d = self._data
        lines = [
            "LSB: steps of each tensor's own scale; carried LSB: the most the differences of its "
            "inputs can move it (within that + 1 LSB: 'rounding' carried from earlier tensors)",
            f"reference engine: {d['reference']}; engines: {', '.join(d['engines'])}",
        ]
        fd = d["first_divergence"]
        if fd is None:
            lines.append(
                "first divergence: none (quantized pairs within 1 LSB, or within what their "
                "inputs carried)"
            )
        else:  # a float tensor (a graph's float output) has no LSB: its largest difference
            carried = fd.get("carried_lsb") or 0.0
            apart = (
                f"{fd['max_lsb']:.2f} LSB from {fd['a']}, its inputs carried {carried:.2f} LSB"
                if fd["max_lsb"] is not None
                else f"max |difference| {fd.get('max_abs', float('nan')):.3g} from {fd['a']} "
                "(a float tensor)"
            )
            lines.append(
                f"first divergence: {fd['name']} (#{fd['order']}, layer {fd['layer']}): "
                f"{fd['b']} is {apart}: the first tensor the two engines compute differently"
            )
        lines.extend(_output_lines(self.tensors))
        blocked = d.get("group_wise_weights") or []
        if blocked:
            lines.append(f"group-wise weights ({len(blocked)}): " + "; ".join(blocked[:4])
                         + (" ..." if len(blocked) > 4 else ""))  # fmt: skip
        lines.extend(f"note: {line}" for line in d.get("int8_activation_products") or [])
        for engine, reason in d["errors"].items():
            lines.append(f"engine {engine} failed: {reason}")
        lines.extend(_pairing_lines(self.tensors))
        for engine, names in d["unmatched"].items():
            shown = ", ".join(describe_tensor(n, self.tensors) for n in names[:6])
            shown += " ..." if len(names) > 6 else ""
            lines.append(f"{engine}: {len(names)} tensors not matched ({shown})")
        return lines

    def __str__(self) -> str:
        rows = self.table()
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        text = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join([*text, *self.summary()])

    def __rich__(self):
        """A rich Table of the worst tensors (``rich.print(result)``)."""
        from rich.console import Group
        from rich.table import Table

        rows = self.table()
        table = Table(*rows[0], title="worst tensors")
        for r in rows[1:]:
            table.add_row(*r, style="red" if r[5] == "divergence" else None)
        return Group(table, *self.summary())

    def __repr__(self) -> str:
        fd = self.first_divergence
        where = fd["name"] if fd else None
        return f"CompareResult({len(self.tensors)} tensors, first_divergence={where!r})"
