"""``quantbridge compare``: the command over ``compare`` (its arguments: ``quantbridge._cli_debug``).

    quantbridge compare A.onnx [B.onnx] --inputs SAMPLES.npz [--engines E,E,..]
                        [--reference E] [--worst N] [--json OUT.json] [--report REPORT.html]

Prints the worst tensors, the first divergence, failed engines and unmatched tensors. Exit codes:
0 done (whatever the classes), 2 bad usage or input, reported on one line.
"""

from __future__ import annotations

import argparse
import json
import sys

from ._report_html import render_html
from .compare import compare


def run(args: argparse.Namespace) -> int:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()] if args.engines else None
    try:
        result = compare(
            args.model, args.other, inputs=args.inputs, engines=engines, reference=args.reference
        )
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        print(f"quantbridge compare: error: {e}", file=sys.stderr)
        return 2
    rows = result.table(args.worst)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print("\n".join(result.summary()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=1)
        print(f"wrote {args.json}")
    if args.report:
        with open(args.report, "w") as f:
            f.write(render_html(result.to_json(), None))
        print(f"wrote {args.report}")
    return 0
