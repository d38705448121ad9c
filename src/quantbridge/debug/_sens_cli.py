"""``quantbridge sensitivity MODEL.onnx --calib C.npz --eval E.npz -o recipe.yaml``: the command
line of ``qb.sensitivity`` (``add_parser`` registers it, ``run`` runs it). No logic of its own."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "sensitivity",
        help="rank layers by quantization sensitivity; write the recipe that meets a budget",
        description="Quantize MODEL.onnx, measure each layer quantized alone and each layer kept "
        "float alone on the evaluation set, rank the layers, and (with --budget) find the "
        "fewest layers to keep float (or at int16 activations) for the metric to reach the "
        "budget, verified by quantizing again. -o writes that recipe for quantbridge quantize.",
    )
    p.add_argument("model", metavar="MODEL.onnx", help="a float ONNX file")
    p.add_argument("--calib", required=True, metavar="CALIB", help=".npz file or folder")
    p.add_argument(
        "--eval", required=True, metavar="EVAL.npz",
        help="evaluation arrays keyed by input name (an array 'labels' for top1 accuracy)",
    )  # fmt: skip
    p.add_argument("--metric", choices=("sqnr", "cosine", "top1"), default="cosine")
    p.add_argument(
        "--budget",
        type=float,
        help="lower bound on the metric (sqnr: dB; cosine: 0.999; top1: 0.98)",
    )
    p.add_argument(
        "--wider", choices=("int16",),
        help="repair with int16 activations instead of float layers",
    )  # fmt: skip
    p.add_argument(
        "--recipe", default="native", metavar="NAME|FILE",
        help="base recipe: preset or .yaml/.json file (default: native)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, help="samples per forward pass (default 8)")
    p.add_argument("-o", "--output", metavar="RECIPE.yaml", help="write the recipe here")
    p.add_argument("--report", metavar="REPORT.html", help="write the HTML report here")
    p.add_argument("--json", metavar="OUT.json", help="write the result as JSON here")
    p.add_argument("--top", type=int, default=15, help="layers in the terminal table")
    p.add_argument("--quiet", action="store_true", help="no progress lines, no table")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ._report_html import render_html  # here: quantbridge --help needs none of them
    from ._sens_table import print_sensitivity
    from ._sensitivity import sensitivity

    try:
        result = sensitivity(
            args.model,
            args.calib,
            args.eval,
            recipe=args.recipe,
            metric=args.metric,
            budget=args.budget,
            wider=args.wider,
            batch_size=args.batch_size,
            progress=not args.quiet,
        )
        data = result.to_json()
        if args.output:
            result.write_recipe(args.output)
        if args.json:
            Path(args.json).write_text(json.dumps(data, indent=2, allow_nan=False))
        if args.report:
            Path(args.report).write_text(render_html(None, data))
    except (ValueError, TypeError, OSError) as e:
        print(f"quantbridge sensitivity: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # -o recipe.yaml without PyYAML
        print(f"quantbridge sensitivity: error: {e} (pip install pyyaml)", file=sys.stderr)
        return 2
    if not args.quiet:
        print_sensitivity(data, args.top)
        if args.output:
            print(f"wrote {args.output}")
    return 0
