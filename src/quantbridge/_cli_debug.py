"""The arguments of ``quantbridge compare`` and ``quantbridge sensitivity``, outside the debug
layer: ``quantbridge --help`` builds every parser, and importing ``quantbridge.debug`` loads
ONNX Runtime, the engines and the report. Each command imports the debug layer's ``run`` when
it runs (``debug/_cli.py``, ``debug/_sens_cli.py``)."""

from __future__ import annotations

import argparse


def _engines_help() -> str:
    """The ``--engines`` help, built when shown (the engines import onnxruntime, OpenVINO)."""
    from .debug._engines import ENGINES

    return (
        f"engines to run: {','.join(ENGINES)} (default: all that run the model; with two "
        "models, ort-ref on each)"
    )


def add_compare(sub) -> None:
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
    cmp.set_defaults(run=_run_compare)


def add_sensitivity(sub) -> argparse.ArgumentParser:
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
    p.set_defaults(run=_run_sensitivity)
    return p


def _run_compare(args: argparse.Namespace) -> int:
    from .debug._cli import run

    return run(args)


def _run_sensitivity(args: argparse.Namespace) -> int:
    from .debug._sens_cli import run

    return run(args)
