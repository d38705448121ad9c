"""The terminal table of ``quantbridge sensitivity``: a layer name is what the user copies into a
recipe rule, so it is wrapped whole, never cut. Regression: at 80 columns (a pipe, CI logs) every
BERT layer read ``bert_encoder_l…``, found running the ``--help`` example on a BERT."""

from __future__ import annotations

import io
import re

from rich.console import Console

from quantbridge.debug._sens_table import print_sensitivity

NAME = "bert_encoder_layer_1_attention_output_dense_MatMul"


def test_long_layer_names_are_wrapped_whole_at_80_columns():
    row = {"op": "MatMul", "all_but_this_quantized": 0.998, "only_this_quantized": 1.0}
    result = {
        "metric": "cosine",
        "baseline": {"float": 1.0, "quantized": 0.99},
        "layers": [{**row, "name": NAME, "rank": 1, "repairable": True, "note": ""}],
    }
    out = io.StringIO()
    print_sensitivity(result, console=Console(width=80, file=out))
    text = out.getvalue()
    assert "…" not in text
    layer_column = "".join(re.findall(r"│\s+\d*\s+│ (\S+)", text))  # the folded pieces in order
    assert layer_column == NAME
