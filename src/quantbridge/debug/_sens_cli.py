"""``quantbridge sensitivity MODEL.onnx --calib C.npz --eval E.npz -o recipe.yaml``: the command
line of ``qb.sensitivity`` (its arguments: ``quantbridge._cli_debug``). No logic of its own."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ._report_html import render_html
from ._sens_table import print_sensitivity
from ._sensitivity import sensitivity


def run(args: argparse.Namespace) -> int:
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
