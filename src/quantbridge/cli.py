"""The ``quantbridge`` command: thin wrappers over the public API, no logic of their own.

    quantbridge demo [--epochs N] [--out DIR] [--recipe NAME] [--seed N] [--json] [--quiet]
    quantbridge inspect MODEL.onnx|PROGRAM.npz [--json] [--verbose] [--fixed-point]
    quantbridge fold MODEL.onnx -o OUT.onnx
    quantbridge lower MODEL.onnx -o OUT --emit onnx|npz|c [--c-dir DIR] [--input-shape N=D,D..]
    quantbridge quantize MODEL.onnx --calib CALIB.npz|DIR -o OUT.onnx [--recipe NAME|FILE.yaml]
                         [--method M] [--opset N] [--batch-size N] [--int8-head]
                         [--format qdq|qoperator] [--quiet]
    quantbridge compare A.onnx [B.onnx] --inputs SAMPLES.npz [--engines E,..] [--json OUT]
    quantbridge sensitivity MODEL.onnx --calib C.npz --eval E.npz [--metric M] [--budget X] -o R.yaml
    quantbridge --version

Exit codes: 0 success; 1 the demo ran but one of its checks failed; 2 bad usage or input (missing
file, not an ONNX model, unknown recipe) - reported on one line, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence

from . import __version__
from ._cli_debug import add_compare, add_sensitivity
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

    if args.fixed_point or str(args.model).endswith(".npz"):
        return _inspect_fixed_point(args)
    try:
        report = inspect_model(args.model)
    except (ValueError, OSError) as e:
        return _fail("inspect", e)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format(args.verbose))
    return 0


def _inspect_fixed_point(args: argparse.Namespace) -> int:
    """A lowered program (``.npz``), or the program an ONNX file lowers to: formats, requantizations."""
    from .integer import describe_fixed_point, load_npz, lower, requantizations

    try:
        prog = load_npz(args.model) if str(args.model).endswith(".npz") else lower(args.model)
    except (ValueError, OSError) as e:
        return _fail("inspect", e)
    if args.json:
        print(json.dumps({"tensors": prog.formats(), "requantizations": requantizations(prog)}))
    else:
        print(describe_fixed_point(prog))
    return 0


def _fold(args: argparse.Namespace) -> int:
    from .onnx import fold, inspect_model

    try:
        folded = fold(args.model, args.output)
        report = inspect_model(args.output)
    except (ValueError, TypeError, OSError) as e:
        return _fail("fold", e)
    print(f"wrote {args.output} ({report.form})")
    print("op counts: " + ", ".join(f"{k} {v}" for k, v in sorted(report.op_counts.items())))
    outputs = {v.name for v in folded.graph.output}
    ends = {  # the graph's float outputs: computed from int8 codes, written in float by design
        f"{n.op_type} {n.name!r}" for n in folded.graph.node if n.name and set(n.output) & outputs
    }
    float_out = [label for label in report.qdq_ops if label in ends]
    others = [label for label in report.qdq_ops if label not in ends]
    if others:
        print(f"not folded (QDQ form): {', '.join(others)}")
    if float_out:
        print(
            "left in QDQ form by the recipe, float outputs (int8 inputs and weights, a float "
            f"result, as the default recipe's logits): {', '.join(float_out)}"
        )
    return 0


def _shapes(specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for spec in specs:
        name, _, dims = spec.partition("=")
        try:
            shapes[name] = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise ValueError(f"--input-shape {spec!r}: expected NAME=D,D,... of integers") from None
    return shapes


def _lower(args: argparse.Namespace) -> int:
    from .integer import lower, save_npz

    try:
        if args.emit != "c" and not args.output:
            raise ValueError(f"--emit {args.emit} needs -o OUT")
        shapes = _shapes(args.input_shape) or None
        prog = lower(args.model, accumulator_bits=args.accumulator_bits, input_shapes=shapes,
                     float_outputs=args.float_outputs)  # fmt: skip
        if args.emit == "onnx":
            prog.save_onnx(args.output, shapes)
            written = [args.output]
        elif args.emit == "npz":
            save_npz(prog, args.output)
            written = [args.output]
        else:
            written = prog.emit_c(args.c_dir or args.output or ".", shapes)
    except (ValueError, OSError) as e:
        return _fail("lower", e)
    print(f"{prog!r}\nwrote {', '.join(map(str, written))}")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from .onnx import fold, inspect_model, quantize_onnx

    qdq = args.output if args.format == "qdq" else f"{args.output}.qdq.onnx"
    try:
        quantize_onnx(
            args.model,
            args.calib,
            qdq,
            recipe=args.recipe,
            method=args.method,
            opset=args.opset,
            progress=not args.quiet,
            batch_size=args.batch_size,
            float_head=not args.int8_head,
        )
        if args.format == "qoperator":  # the QDQ file folded into QLinearConv, QGemm, ...
            fold(qdq, args.output)
    except (ValueError, TypeError, OSError) as e:
        return _fail("quantize", e)
    finally:
        if qdq != args.output and os.path.exists(qdq):
            os.remove(qdq)
    if not args.quiet:
        report = inspect_model(args.output)
        print(
            f"wrote {args.output}: {sum(report.int8_ops.values())} ops in int8, "
            f"{sum(report.float_ops.values())} in float (details: quantbridge inspect "
            f"{args.output})"
        )
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
    inspect.add_argument(
        "--fixed-point", action="store_true",
        help="lower the model and show each tensor's fixed-point format and each requantization "
        "(multiplier, shift); the default for a lowered program (.npz)",
    )  # fmt: skip
    inspect.set_defaults(run=_inspect)

    fold = sub.add_parser(
        "fold",
        help="fold a QDQ model into ONNX integer operators (QLinearConv, QLinearAdd, ...)",
        description="Rewrite DequantizeLinear -> op -> QuantizeLinear groups as ONNX Runtime's "
        "integer operators; ops without an integer form stay in QDQ form and are listed.",
    )
    fold.add_argument("model", metavar="MODEL.onnx", help="a QDQ ONNX file")
    fold.add_argument("-o", "--output", required=True, metavar="OUT.onnx", help="folded file")
    fold.set_defaults(run=_fold)

    low = sub.add_parser(
        "lower",
        help="lower a quantized ONNX model to an integer-only program (ONNX, npz or C99)",
    )
    low.add_argument("model", metavar="MODEL.onnx", help="QDQ (or QLinear*) ONNX file")
    low.add_argument("-o", "--output", metavar="OUT", help="output file (onnx, npz)")
    low.add_argument("--emit", choices=("onnx", "npz", "c"), default="onnx", help="(default: onnx)")
    low.add_argument("--c-dir", metavar="DIR", help="folder for qb_model.c/.h (--emit c)")
    low.add_argument(
        "--input-shape", action="append", default=[], metavar="NAME=D,D,..",
        help="static input shape to lower for (default: the model's, symbolic dims = 1 in onnx/c)",
    )  # fmt: skip
    low.add_argument(
        "--float-outputs", choices=("refuse", "dequantize"), default="dequantize",
        help="dequantize: a float function of the last codes (a final Sigmoid) is a float table "
        "applied outside the program, which outputs the codes; a final layer norm outputs int16 "
        "codes; a weighted layer's float output (quantize_outputs=False) outputs its int32 "
        "accumulator, scaled outside (the default: qb.quantize's default keeps logits float); "
        "refuse: every output must be quantized",
    )  # fmt: skip
    low.add_argument(
        "--accumulator-bits", type=int, default=32, choices=(32, 64),
        help="accept layers whose sums need int64 (default: refuse beyond int32)",
    )  # fmt: skip
    low.set_defaults(run=_lower)

    quant = sub.add_parser(
        "quantize",
        help="a float ONNX model in, a calibrated INT8 (QDQ) ONNX model out",
        description="Quantize a float ONNX model with calibration data: arrays keyed by graph "
        "input name, samples on axis 0, in an .npz file or a folder of .npy/.npz files.",
    )
    quant.add_argument("model", metavar="MODEL.onnx", help="path to a float ONNX file")
    quant.add_argument("--calib", required=True, metavar="CALIB", help=".npz file or folder")
    quant.add_argument("-o", "--output", required=True, metavar="OUT.onnx", help="output file")
    quant.add_argument(
        "--recipe",
        default="default",
        metavar="NAME|FILE",
        help="recipe preset (default, int8, int8_avx2, int8_symmetric, w4a8, pow2, native) or a "
        ".yaml/.json recipe file (default: 'default', see quantbridge.recipe)",
    )
    quant.add_argument(
        "--method",
        choices=["minmax", "percentile", "entropy", "mse"],
        help="calibration method of the activations (default: the recipe's)",
    )
    quant.add_argument("--opset", type=int, help="opset of the output (>= 13; default 18)")
    quant.add_argument(
        "--batch-size", type=int, help="samples per calibration pass (default 8 or the file's)"
    )
    quant.add_argument(
        "--int8-head",
        action="store_true",
        help="quantize the layers before a final Sigmoid/Softmax too (default: float)",
    )
    quant.add_argument(
        "--format", choices=("qdq", "qoperator"), default="qdq",
        help="qdq (default), or qoperator: folded into ONNX integer operators (as quantbridge fold)",
    )  # fmt: skip
    quant.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    quant.set_defaults(run=_quantize)

    add_compare(sub)  # quantbridge compare (the debug layer, imported when it runs)
    add_sensitivity(sub)  # quantbridge sensitivity
    for name, command in sub.choices.items():  # every --help: what it does, then an example
        command.formatter_class = _ExampleFormatter
        command.description = command.description or _capitalised(sub, name)
        command.epilog = f"example:\n  {EXAMPLES[name]}"
    parser.formatter_class = _ExampleFormatter
    parser.epilog = "examples:\n" + "".join(f"  {EXAMPLES[n]}\n" for n in EXAMPLES)
    parser.epilog += "\n'quantbridge COMMAND --help' for each command's options."
    return parser


# one command line per subcommand, shown under its --help and under quantbridge --help
EXAMPLES = {
    "demo": "quantbridge demo --epochs 2 --out demo_files",
    "quantize": "quantbridge quantize model.onnx --calib calib.npz -o model.int8.onnx",
    "inspect": "quantbridge inspect model.int8.onnx --verbose",
    "compare": "quantbridge compare model.int8.onnx --inputs calib.npz",
    "sensitivity": "quantbridge sensitivity model.onnx --calib calib.npz --eval eval.npz "
    "--budget 0.99 -o recipe.yaml",
    "fold": "quantbridge fold model.int8.onnx -o model.qop.onnx",
    "lower": "quantbridge lower model.int8.onnx -o model.int.onnx --emit onnx",
}


class _ExampleFormatter(argparse.HelpFormatter):
    """Descriptions wrapped as usual; the examples epilog kept line by line (a command line
    wrapped at the terminal's width could not be copied). A help given as a function is called
    when shown (``compare --engines`` lists the engines, which import onnxruntime)."""

    def _format_action(self, action: argparse.Action) -> str:
        if callable(action.help):
            action.help = action.help()
        return super()._format_action(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("example"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _capitalised(sub, name: str) -> str:
    """The one-line help of subcommand ``name`` as its description."""
    text = next(a.help for a in sub._choices_actions if a.dest == name)
    return text[0].upper() + text[1:] + "."


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
    missing = _missing_output_folder(args)
    if missing:  # before the work: lowering or calibrating first and then failing costs minutes
        return _fail(args.command, missing)
    with quiet_torch(), warnings.catch_warnings():  # quiet_torch: the demo's other torch calls
        warnings.simplefilter("default")
        warnings.showwarning = _warning_printer(args.command)
        return args.run(args)


def _missing_output_folder(args: argparse.Namespace) -> str:
    """The error for an output file (``-o``, ``--report``, ``--json FILE``) whose folder does not
    exist; '' when every folder does."""
    for option in ("output", "report", "json"):
        path = getattr(args, option, None)
        if not isinstance(path, str):  # --json of demo / inspect is a switch
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            flag = "-o" if option == "output" else f"--{option}"
            return f"{flag} {path}: folder {folder!r} does not exist; create it first"
    return ""


def _warning_printer(command: str):
    """``warnings.showwarning`` for a command: ``quantbridge CMD: warning: ...`` on stderr, once per
    text (``compare`` imports a file once per engine), without the source line (quantbridge's
    own, or ``sys:1``: no user code is on the stack)."""
    shown: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if str(message) not in shown:
            shown.add(str(message))
            print(f"quantbridge {command}: warning: {message}", file=file or sys.stderr)

    return show


__all__ = ["main"]
