"""MiniLM-L6: the recipe ``qb.sensitivity`` finds for a cosine budget, against the hand-written
skip rules of ``examples/minilm.py`` (``DEFAULT_SKIP``: every FFN output projection and the
residual add after it kept float).

    python examples/minilm_sensitivity.py                    # budget 0.99, 48 calib / 222 eval
    python examples/minilm_sensitivity.py --n-eval 40 --json out.json --report report.html

Both recipes start from the ``native`` preset with minmax calibration on the same calibration
sentences, and both are measured the same way: mean cosine(int8 embedding, float embedding) over
the evaluation sentences in torch fake-quant (``SensitivityResult.achieved`` for the found one).

Measured with the rank-order repair (``--n-eval 40``, 48 calibration sentences, budget 0.99, a
2-core machine under heavy load: 75 minutes): all quantized 0.8553; 24 layers kept float, 0.9931;
the hand-written rules keep 12 (the six ``layer.N.output`` + ``layer.N.output.dense``), 0.9918.
Per-layer estimates do not add up, so rank order kept twice the layers needed.

With the set search (``_sens_search``: families forward, then pruning on the estimate and on the
re-quantized metric; ``--n-eval 16``, load 12-19, 28 minutes, 16 re-quantizations): all
quantized 0.8538; **8 layers kept float** (the six residual adds ``layer.N.output`` and
``layer.0/2.output.dense``) -> 0.9905; the hand-written 12 -> 0.9919 on the same 16 sentences.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

import quantbridge as qb
from quantbridge.debug import render_html, sensitivity
from quantbridge.debug._sens_table import print_sensitivity

HERE = Path(__file__).resolve().parent


def _minilm():
    spec = importlib.util.spec_from_file_location("quantbridge_example_minilm", HERE / "minilm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def mean_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.mean((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


def embed(model, batches) -> np.ndarray:
    with torch.no_grad():
        return np.concatenate([model(**b).numpy() for b in batches])


def run(budget: float = 0.99, n_calib: int = 48, n_eval: int | None = None, batch: int = 16):
    ex = _minilm()
    from sentences import split  # examples/ is on sys.path once minilm.py is loaded

    calib_s, eval_s = split(n_calib, n_eval)
    embedder, tokenizer = ex.load_embedder()
    calib = ex.batched(tokenizer, calib_s, batch, 64, "max_length")
    evals = ex.batched(tokenizer, eval_s, batch, 64, "max_length")
    start = time.perf_counter()
    result = sensitivity(embedder, calib, evals, recipe="native", metric="cosine", budget=budget)
    seconds = time.perf_counter() - start
    ref = embed(embedder, evals)
    hand = qb.quantize(embedder, calib, ex.make_recipe(), progress=False)
    hand_cos = mean_cosine(embed(hand, evals), ref)
    found = qb.quantize(embedder, calib, result.recipe, progress=False)
    found_cos = mean_cosine(embed(found, evals), ref)
    return result, {
        "budget": budget,
        "calibration_sentences": len(calib_s),
        "evaluation_sentences": len(eval_s),
        "layers_ranked": len(result.layers),
        "sensitivity_seconds": round(seconds, 1),
        "all_quantized": result.baseline["quantized"],
        "found": {
            "keep_float": result.keep_float,
            "cosine_reported": result.achieved,
            "cosine_requantized": found_cos,
        },
        "hand_written": {"skip": list(ex.DEFAULT_SKIP), "cosine": hand_cos},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=0.99)
    p.add_argument("--n-calib", type=int, default=48)
    p.add_argument("--n-eval", type=int)
    p.add_argument("--json", metavar="OUT.json")
    p.add_argument("--report", metavar="REPORT.html")
    p.add_argument("--recipe", metavar="RECIPE.yaml", help="write the found recipe")
    args = p.parse_args(argv)
    result, summary = run(args.budget, args.n_calib, args.n_eval)
    print_sensitivity(result.to_json(), 20)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, **result.to_json()}, indent=2))
    if args.report:
        Path(args.report).write_text(render_html(None, result.to_json()))
    if args.recipe:
        result.write_recipe(args.recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
