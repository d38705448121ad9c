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
