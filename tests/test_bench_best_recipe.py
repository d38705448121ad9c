"""The bench's "ours best" row (``bench.suite.peers.BEST``) runs in every accuracy run, quick
included, with the combination measured best in issue 14: the platform preset, equalization,
bias correction and float graph outputs."""

from __future__ import annotations

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
