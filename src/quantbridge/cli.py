"""The ``quantbridge`` command: thin wrappers over the public API, no logic of their own.

    quantbridge demo [--epochs N] [--out DIR] [--recipe NAME] [--seed N] [--json] [--quiet]
    quantbridge inspect MODEL.onnx [--json] [--verbose]
    quantbridge --version

Exit codes: 0 success; 1 the demo ran but one of its checks failed; 2 bad usage or input (missing
file, not an ONNX model, unknown recipe) - reported on one line, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import __version__
from .torch._capture import quiet_torch
from .torch._progress import progress_enabled, set_progress


def _fail(command: str, error: BaseException) -> int:
    print(f"quantbridge {command}: error: {error}", file=sys.stderr)
    return 2


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    log = (lambda line: None) if args.quiet else None
    was = progress_enabled()
    set_progress(was and not args.quiet)
    try:
        result = run_demo(
            epochs=args.epochs, out=args.out, recipe=args.recipe, seed=args.seed, log=log
        )
    except (ValueError, ImportError, OSError) as e:
        return _fail("demo", e)
    finally:
        set_progress(was)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.format())
    return 0 if result.ok else 1


def _inspect(args: argparse.Namespace) -> int:
    from .onnx import inspect_model

    try:
        report = inspect_model(args.model)
    except (ValueError, OSError) as e:
        return _fail("inspect", e)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format(args.verbose))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantbridge",
        description="INT8 quantization that moves losslessly between PyTorch and ONNX.",
    )
    parser.add_argument("--version", action="version", version=f"quantbridge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="train a digits CNN, quantize it, export it, run it in ONNX Runtime",
        description="Train quantbridge.zoo.DigitsCNN on scikit-learn's digits, quantize it to "
        "INT8, export QDQ ONNX and compare accuracy, size and latency in ONNX Runtime.",
    )
    demo.add_argument("--epochs", type=int, default=8, help="training epochs (default: 8)")
    demo.add_argument("--out", metavar="DIR", help="keep the ONNX files in DIR (default: temp)")
    demo.add_argument(
        "--recipe",
        default="native",
        metavar="NAME",
        help="recipe preset: int8, int8_avx2, int8_symmetric, w4a8, pow2, or native "
        "(default: int8, or int8_avx2 on x86 CPUs without VNNI, whose int8 kernels saturate)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--json", action="store_true", help="print the results as JSON")
    demo.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    demo.set_defaults(run=_demo)

    inspect = sub.add_parser(
        "inspect",
        help="what an ONNX model runs in int8 and in float, and how its weights are stored",
    )
    inspect.add_argument("model", metavar="MODEL.onnx", help="path to an ONNX file")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument("--verbose", action="store_true", help="list every weight")
    inspect.set_defaults(run=_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: argparse has printed already
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    with quiet_torch():  # the library is quiet itself; this covers the demo's other torch calls
        return args.run(args)


__all__ = ["main"]
