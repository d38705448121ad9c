"""``quantbridge compare``: the command over ``compare`` (registered in ``quantbridge.cli``).

    quantbridge compare A.onnx [B.onnx] --inputs SAMPLES.npz [--engines E,E,..]
                        [--reference E] [--worst N] [--json OUT.json] [--report REPORT.html]

Prints the worst tensors, the first divergence, failed engines and unmatched tensors. Exit codes:
0 done (whatever the classes), 2 bad usage or input, reported on one line.
"""

from __future__ import annotations

import argparse
import json
import sys


def _engines_help() -> str:
    """The ``--engines`` help, built when shown (the engines import onnxruntime, OpenVINO)."""
    from ._engines import ENGINES

    return (
        f"engines to run: {','.join(ENGINES)} (default: all that run the model; with two "
        "models, ort-ref on each)"
    )


def add_parser(sub) -> None:
    """Register the ``compare`` subcommand on the ``argparse`` subparsers ``sub``."""
    cmp = sub.add_parser(
        "compare",
        help="run the same inputs through every engine and compare each tensor in LSBs",
        description="Compare a quantized ONNX model across engines (or two models), tensor by "
        "tensor, in steps (LSBs) of each tensor's scale; names the first diverging tensor.",
    )
    cmp.add_argument("model", metavar="A.onnx", help="a QDQ, QOperator or float ONNX file")
    cmp.add_argument("other", metavar="B.onnx", nargs="?", help="a second model to compare with")
    cmp.add_argument(
        "--inputs", required=True, metavar="SAMPLES.npz", help="arrays keyed by input name"
    )
    cmp.add_argument(
        "--engines",
        metavar="E,E,..",
        help=_engines_help,  # called by quantbridge.cli's formatter
    )
    cmp.add_argument("--reference", metavar="E", help="run to measure against (default ort-ref)")
    cmp.add_argument("--worst", type=int, default=10, metavar="N", help="rows shown (default 10)")
    cmp.add_argument("--json", metavar="OUT.json", help="write the quantbridge.compare/1 JSON")
    cmp.add_argument("--report", metavar="REPORT.html", help="write the HTML report")
    cmp.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ._report_html import render_html
    from .compare import compare

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
