"""``render_html``: one self-contained HTML report (no network resource: inline CSS, inline SVG
charts, a few lines of inline JS) from the JSON dicts of ``compare`` and ``sensitivity``
(the shapes of ``quantbridge.compare/1`` and ``quantbridge.sensitivity/1``).

Sections, each present when its data is:

* compare: the models, engines and reference, engines that failed, unmatched tensors;
  the first divergence (the automatic bisection); a per-layer SQNR chart (one line per engine
  pair, tensors in topological order); LSB-error histograms of the worst tensors; a table of the
  worst tensors with their class;
* sensitivity: the baselines, a bar chart of every layer's ``all_but_this_quantized`` and
  ``only_this_quantized`` in rank order, the layers the recipe keeps float / wider, and the
  metric the recipe achieved.

Charts are SVG drawn here (every value escaped); the JS only makes the tables sortable.
"""

from __future__ import annotations

import html
import math
from typing import Any

from ._result import describe_tensor

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
SQNR_CAP = 120.0  # dB drawn for identical tensors (null SQNR) and anything above it
WORST_HISTOGRAMS = 6
WORST_ROWS = 20

_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:28px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f3f3f3;cursor:pointer}.bad{color:#b00020;font-weight:600}.ok{color:#1b7e2d}
.box{background:#fff6e5;border:1px solid #f0c36d;padding:8px 12px;display:inline-block}
.hists{display:flex;flex-wrap:wrap;gap:12px}svg{background:#fcfcfc;border:1px solid #eee}
"""

# sorts a table by the clicked column (numbers numerically); no other behaviour
_JS = """
document.querySelectorAll('table.sortable th').forEach(function (th, col) {
  th.addEventListener('click', function () {
    var body = th.closest('table').tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var asc = th.dataset.asc !== '1';
    th.dataset.asc = asc ? '1' : '0';
    rows.sort(function (a, b) {
      var x = a.cells[col].textContent, y = b.cells[col].textContent;
      var nx = parseFloat(x), ny = parseFloat(y);
      var r = (isNaN(nx) || isNaN(ny)) ? x.localeCompare(y) : nx - ny;
      return asc ? r : -r;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
document.body.dataset.ready = '1';
"""


def render_html(compare: dict | None = None, sensitivity: dict | None = None) -> str:
    """The report as one HTML string (write it to a ``.html`` file and open it offline)."""
    if compare is None and sensitivity is None:
        raise ValueError("render_html needs a compare result, a sensitivity result, or both")
    for what, d, schema in (
        ("compare", compare, "quantbridge.compare/"),
        ("sensitivity", sensitivity, "quantbridge.sensitivity/"),
    ):
        if d is not None and not str(d.get("schema", "")).startswith(schema):
            raise ValueError(
                f"render_html({what}=...): expected the to_json() dict of {what} (schema "
                f"{schema}1), got schema {d.get('schema')!r}"
            )
    parts = ["<h1>quantbridge report</h1>"]
    if compare is not None:
        parts.append(_compare_section(compare))
    if sensitivity is not None:
        parts.append(_sensitivity_section(sensitivity))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        "<title>quantbridge report</title>"
        f"<style>{_CSS}</style></head><body>{''.join(parts)}<script>{_JS}</script></body></html>\n"
    )


# -- compare ---------------------------------------------------------------------------------------
def _compare_section(c: dict) -> str:
    e = html.escape
    out = ["<h2>Cross-engine comparison</h2>"]
    out.append(
        f"<p>models: {e(', '.join(map(str, c.get('models', []))))}<br>engines: "
        f"{e(', '.join(c.get('engines', [])))} (reference: <b>{e(str(c.get('reference')))}</b>)</p>"
    )
    for engine, reason in (c.get("errors") or {}).items():
        out.append(f'<p class="bad">{e(engine)} failed: {e(str(reason))}</p>')
    for engine, names in (c.get("unmatched") or {}).items():
        if names:
            shown = ", ".join(describe_tensor(str(n), c.get("tensors") or []) for n in names[:20])
            shown += " ..." if len(names) > 20 else ""
            out.append(f"<p>{e(engine)}: {len(names)} unmatched tensors ({e(shown)})</p>")
    fd = c.get("first_divergence")
    if fd:
        out.append(
            '<p class="box" id="first-divergence">first divergence: <b>'
            f"{e(str(fd.get('name')))}</b> (#{e(str(fd.get('order')))}) between "
            f"{e(str(fd.get('a')))} and {e(str(fd.get('b')))}, max {_num(fd.get('max_lsb'))} LSB</p>"
        )
    else:
        out.append('<p class="box ok" id="first-divergence">no divergence: every pair of integer '
                   "engines agrees within 1 LSB</p>")  # fmt: skip
    tensors = c.get("tensors") or []
    out.append("<h3>SQNR per tensor (dB, topological order)</h3>")
    out.append(_sqnr_chart(tensors))
    worst = _worst_pairs(tensors)
    hists = [(t, p) for t, p in worst if p.get("lsb_hist")][:WORST_HISTOGRAMS]
    if hists:
        out.append("<h3>LSB error of the worst tensors</h3><div class='hists'>")
        out.extend(_histogram(t, p) for t, p in hists)
        out.append("</div>")
    rows = [
        [t.get("order"), t.get("name"), t.get("layer") or "", t.get("op") or "",
         f"{p.get('a')} / {p.get('b')}", _num(p.get("sqnr_db")), _num(p.get("cosine"), 6),
         _num(p.get("max_abs")), _share(p.get("lsb_share")), p.get("class", "")]
        for t, p in worst[:WORST_ROWS]
    ]  # fmt: skip
    heads = ["#", "tensor", "layer", "op", "pair", "SQNR dB", "cosine", "max abs", "LSB 0/1/2/>2",
             "class"]  # fmt: skip
    out.append("<h3>Worst tensors</h3>" + _table(heads, rows, "worst-tensors"))
    return "".join(out)


def _pairs(tensors: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for t in tensors:
        for p in t.get("pairs", []):
            seen.setdefault(f"{p.get('a')} / {p.get('b')}")
    return list(seen)


def _sqnr(p: dict) -> float:
    v = p.get("sqnr_db")
    return SQNR_CAP if v is None or not math.isfinite(v) else min(float(v), SQNR_CAP)


def _worst_pairs(tensors: list[dict]) -> list[tuple[dict, dict]]:
    """(tensor, pair) for every tensor's worst pair, lowest SQNR first."""
    worst = [(t, min(t["pairs"], key=_sqnr)) for t in tensors if t.get("pairs")]
    return sorted(worst, key=lambda tp: _sqnr(tp[1]))


def _sqnr_chart(tensors: list[dict]) -> str:
    width, height, left, top, bottom = 1000, 320, 50, 12, 30
    pairs = _pairs(tensors)
    if not tensors or not pairs:
        return "<p>no tensors were compared</p>"
    values = [_sqnr(p) for t in tensors for p in t.get("pairs", [])]
    lo, hi = min(0.0, min(values)), max(values) + 5.0
    n = len(tensors)

    def x(i: int) -> float:
        return left + (width - left - 10) * (i / max(n - 1, 1))

    def y(v: float) -> float:
        return top + (height - top - bottom) * (1 - (v - lo) / (hi - lo))

    svg = [
        f'<svg id="sqnr-chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
    ]
    for tick in _ticks(lo, hi):
        svg.append(
            f'<line x1="{left}" x2="{width - 10}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" '
            f'stroke="#e5e5e5"/><text x="{left - 6}" y="{y(tick) + 4:.1f}" font-size="11" '
            f'text-anchor="end">{tick:g}</text>'
        )
    for k, pair in enumerate(pairs):
        color = COLORS[k % len(COLORS)]
        points = []
        for i, t in enumerate(tensors):
            for p in t.get("pairs", []):
                if f"{p.get('a')} / {p.get('b')}" == pair:
                    points.append((i, t, p))
        path = " ".join(f"{x(i):.1f},{y(_sqnr(p)):.1f}" for i, _, p in points)
        svg.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for i, t, p in points:
            tip = html.escape(
                f"{t.get('name')} [{pair}] {_num(p.get('sqnr_db'))} dB {p.get('class', '')}"
            )
            svg.append(
                f'<circle cx="{x(i):.1f}" cy="{y(_sqnr(p)):.1f}" r="2.5" fill="{color}">'
                f"<title>{tip}</title></circle>"
            )
        svg.append(
            f'<rect x="{left + 10 + 190 * k}" y="{height - 16}" width="10" height="10" '
            f'fill="{color}"/><text x="{left + 24 + 190 * k}" y="{height - 7}" font-size="11">'
            f"{html.escape(pair)}</text>"
        )
    svg.append("</svg>")
    return "".join(svg)


def _histogram(t: dict, p: dict) -> str:
    width, height, pad = 260, 150, 22
    hist = [(int(b), int(c)) for b, c in p["lsb_hist"]]
    top = max((c for _, c in hist), default=0) or 1
    bar = (width - 2 * pad) / max(len(hist), 1)
    title = html.escape(f"{t.get('name')} ({p.get('a')} / {p.get('b')})")
    svg = [f'<svg class="lsb-hist" width="{width}" height="{height}"><text x="4" y="13" '
           f'font-size="11">{title}</text>']  # fmt: skip
    for k, (lsb, count) in enumerate(hist):
        # log scale: a handful of 3-LSB elements must stay visible next to a million zeros
        h = (height - 2 * pad - 6) * math.log1p(count) / math.log1p(top)
        color = "#2ca02c" if lsb == 0 else "#ff7f0e" if abs(lsb) == 1 else "#d62728"
        xk = pad + k * bar
        svg.append(
            f'<rect x="{xk + 1:.1f}" y="{height - pad - h:.1f}" width="{max(bar - 2, 1):.1f}" '
            f'height="{h:.1f}" fill="{color}"><title>{lsb} LSB: {count}</title></rect>'
            f'<text x="{xk + bar / 2:.1f}" y="{height - 8}" font-size="9" text-anchor="middle">'
            f"{lsb}</text>"
        )
    svg.append("</svg>")
    return "".join(svg)


# -- sensitivity -----------------------------------------------------------------------------------
def _sensitivity_section(s: dict) -> str:
    e = html.escape
    metric = str(s.get("metric"))
    base = s.get("baseline") or {}
    out = [f"<h2>Layer sensitivity ({e(metric)})</h2>"]
    out.append(
        f"<p>float: {_num(base.get('float'), 6)}, all layers quantized: "
        f"{_num(base.get('quantized'), 6)}</p>"
    )
    if s.get("budget") is not None:
        met = s.get("achieved") is not None and s["achieved"] >= s["budget"]
        kept = s.get("keep_float") or []
        wider = s.get("wider") or {}
        out.append(
            f'<p class="box" id="repair">budget {_num(s["budget"])}: the recipe keeps '
            f"{len(kept)} layer(s) float{': ' + e(', '.join(kept)) if kept else ''}"
            f"{'; wider: ' + e(', '.join(f'{k} ({v})' for k, v in wider.items())) if wider else ''}"
            f' - achieved <span class="{"ok" if met else "bad"}">{_num(s.get("achieved"), 6)}</span>'
            "</p>"
        )
    layers = sorted(s.get("layers") or [], key=lambda r: r.get("rank", 0))
    out.append(_sensitivity_chart(layers, base, metric))
    rows = [
        [r.get("rank"), r.get("name") or "(top level)", r.get("op", ""),
         _num(r.get("all_but_this_quantized"), 6), _num(r.get("only_this_quantized"), 6),
         r.get("note", "")]
        for r in layers
    ]  # fmt: skip
    heads = ["rank", "layer", "op", "all but this quantized", "only this quantized", "note"]
    out.append(_table(heads, rows, "sensitivity-table"))
    return "".join(out)


def _sensitivity_chart(layers: list[dict], base: dict, metric: str) -> str:
    if not layers:
        return "<p>no layers were measured</p>"
    row, left, width = 18, 230, 1000
    height = row * len(layers) + 40
    vals = [
        v for r in layers for v in (r.get("all_but_this_quantized"), r.get("only_this_quantized"))
    ]
    vals += [base.get("quantized"), base.get("float")]
    finite = [float(v) for v in vals if v is not None and math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    lo, hi = (lo - 1.0, hi + 1.0) if hi - lo < 1e-12 else (lo - 0.05 * (hi - lo), hi)

    def x(v) -> float:
        v = hi if v is None or not math.isfinite(v) else v
        return left + (width - left - 20) * (v - lo) / (hi - lo)

    svg = [f'<svg id="sensitivity-chart" width="{width}" height="{height}">']
    for i, r in enumerate(layers):
        yy = 10 + i * row
        name = html.escape(str(r.get("name") or "(top level)"))
        svg.append(
            f'<text x="{left - 6}" y="{yy + 12}" font-size="11" text-anchor="end">{name}</text>'
        )
        for k, (key, color) in enumerate(
            (("all_but_this_quantized", "#1f77b4"), ("only_this_quantized", "#ff7f0e"))
        ):
            v = r.get(key)
            svg.append(
                f'<rect x="{left}" y="{yy + 1 + 8 * k}" width="{max(x(v) - left, 1):.1f}" height="7" '
                f'fill="{color}"><title>{name}: {key} = {_num(v, 6)}</title></rect>'
            )
    q = base.get("quantized")
    if q is not None and math.isfinite(q):
        svg.append(f'<line x1="{x(q):.1f}" x2="{x(q):.1f}" y1="4" y2="{height - 26}" stroke="#d62728" '
                   'stroke-dasharray="4 3"/>')  # fmt: skip
    svg.append(
        f'<text x="{left}" y="{height - 8}" font-size="11">{html.escape(metric)}: blue = all but '
        "this layer quantized, orange = only this layer quantized, dashed = all quantized; "
        f"axis {lo:.4g} .. {hi:.4g}</text></svg>"
    )
    return "".join(svg)


# -- helpers ---------------------------------------------------------------------------------------
def _table(heads: list[str], rows: list[list[Any]], table_id: str) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in heads)
    body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return (f'<table class="sortable" id="{table_id}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")  # fmt: skip


def _ticks(lo: float, hi: float) -> list[float]:
    step = 10.0 ** math.floor(math.log10(max(hi - lo, 1e-9))) or 1.0
    if (hi - lo) / step < 4:
        step /= 2
    start = math.ceil(lo / step) * step
    return [start + k * step for k in range(int((hi - start) / step) + 1)]


def _num(v: Any, digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{float(v):.{digits}g}"


def _share(share: dict | None) -> str:
    if not share:
        return "n/a"
    return "/".join(f"{100 * float(share.get(k, 0.0)):.1f}" for k in ("0", "1", "2", ">2")) + " %"
