"""The bench's "ours best" row (``bench.suite.peers.BEST``) runs in every accuracy run, quick
included, with the combination measured best in issue 14: the platform preset, equalization,
bias correction and float graph outputs."""

from __future__ import annotations

import pytest

import quantbridge as qb
from bench.suite import peers


def test_best_row_is_in_every_run_and_not_the_default():
    for quick in (True, False):
        rows = [c for c in peers.configs(quick) if c.tool == "quantbridge"]
        best = [c for c in rows if c.name == peers.BEST]
        assert len(best) == 1 and not best[0].default, rows


def test_best_recipe_holds_the_measured_methods():
    recipe = peers.ours_factory(peers.BEST)()
    native = qb.Recipe.preset("native")
    assert recipe.weights == native.weights  # 7-bit where this CPU's u8s8 kernels saturate
    assert recipe.equalize is True and recipe.bias_correction is True
    assert recipe.quantize_outputs is False and recipe.adaround is None


def test_ort_compute_tells_int8_from_float_convs(tmp_path):
    # the accuracy rows say what ORT ran: a float file runs its convs in float, our int8 export
    # of the same model runs them as QLinearConv (native: exact on this CPU kind)
    import torch

    from bench.suite.accuracy import ort_compute
    from bench.suite.report_accuracy import _coverage
    from bench.suite.workloads import export_float

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3), torch.nn.ReLU()
    ).eval()
    x = torch.randn(2, 3, 10, 10)
    export_float(model, tmp_path / "f.onnx", x)
    q = qb.quantize(model, [x], "native", progress=False)
    qb.export(q, tmp_path / "q.onnx", x)
    assert ort_compute(tmp_path / "f.onnx") == {"ort_int8_ops": 0, "ort_float_weighted_ops": 2}
    counts = ort_compute(tmp_path / "q.onnx")
    assert counts["ort_int8_ops"] >= 2 and counts["ort_float_weighted_ops"] == 0, counts
    graph = {"activation_q": 3, "float_weights_q": 0, **counts}
    assert _coverage(graph).endswith(f"ORT: {counts['ort_int8_ops']} int8 ops, 0 float conv/gemm")


@pytest.mark.slow
def test_best_recipe_keeps_digits_accuracy_against_ort(tmp_path):
    # a real trained model (the demo's DigitsCNN): equalization + bias correction + 7-bit weights
    # + float logits must not cost accuracy against ONNX Runtime's own quantize_static (u8/s8
    # per channel, minmax) on the same calibration images, both run in ORT's optimized session
    import torch

    from bench.suite import engines, tools
    from bench.suite.workloads import export_float
    from quantbridge.demo import load_digits_split, train

    x_train, y_train, x_test, y_test = load_digits_split(0)
    model = train(x_train, y_train, epochs=4, seed=0, log=lambda line: None)
    pick = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(0))
    calib = list(x_train[pick[:256]].split(64))
    float_path = export_float(model, tmp_path / "digits.float.onnx", x_test[:64])
    name = engines.ort_session(float_path).get_inputs()[0].name
    feeds = [{name: b.numpy()} for b in calib]
    tools.quantize_ort(
        float_path, feeds, "minmax", tmp_path / "ort.onnx", settings={"preprocess": True}
    )
    q = qb.quantize(model, calib, peers.best_recipe(), progress=False)
    qb.export(q, tmp_path / "ours.onnx", x_test[:64])
    accuracy = {}
    for tool in ("ort", "ours"):
        out = engines.ort_outputs(
            engines.ort_session(tmp_path / f"{tool}.onnx"), [{name: x_test.numpy()}]
        )
        accuracy[tool] = float((out.argmax(1) == y_test.numpy()).mean())
    # measured (bench --quick): ours 97.78 %, ORT 98.00 %: one image of 450 apart; two images
    # (0.45 points) is the margin for a platform whose kernels round differently
    assert accuracy["ours"] >= accuracy["ort"] - 0.0045, accuracy
    assert accuracy["ours"] > 0.95, accuracy


def test_transformer_row_runs_on_minilm_in_every_run():
    # ours' best on MiniLM (every Linear int8, >= 0.99 mean cosine: tests/test_minilm_smoothquant)
    # and NNCF's transformer setting beside it, quick runs included
    for quick in (True, False):
        rows = peers.configs(quick)
        ours = [c for c in rows if c.tool == "quantbridge" and c.name == peers.TRANSFORMER]
        nncf = [c for c in rows if c.tool == "nncf" and c.name == "transformer"]
        assert len(ours) == len(nncf) == 1 and ours[0].workloads == nncf[0].workloads == ("minilm",)
    recipe = peers.ours_factory(peers.TRANSFORMER)()
    assert recipe.smoothquant == "auto" and recipe.float_outlier_residuals
    assert recipe.weights == qb.Recipe.preset("native").weights
    # ours' best on MiniLM: NNCF's transformer layout (weighted-op inputs only) plus SmoothQuant
    for quick in (True, False):
        rows = [c for c in peers.configs(quick) if c.name == peers.WEIGHTED_INPUTS]
        assert len(rows) == 1 and rows[0].workloads == ("minilm",)
    best = peers.ours_factory(peers.WEIGHTED_INPUTS)()
    assert best.activation_scope == "weighted_inputs" and best.smoothquant == "auto"
    assert best.weights == qb.Recipe.preset("native").weights


def test_an_extra_row_that_is_already_configured_runs_once():
    # `--ours-recipes` naming a row the figure already has ran it twice (session 11)
    names = [(c.tool, c.name) for c in peers.configs(True, (peers.SPLIT_RANGES, "native"))]
    assert names.count(("quantbridge", peers.SPLIT_RANGES)) == 1
    assert names.count(("quantbridge", "native")) == 1
