"""compare's credit for an error carried through selecting ops of one quantized tensor: the
exporter's ``Where(IsNaN(p), 0, p)`` after a Softmax (ONNX Runtime's QDQ BERT requantizes it on
a grid 7.5x finer than the softmax's: a 1-step difference there was a false "8 LSB" first
divergence on every such file), and Where / Max / Clip / Transpose / Gather of one site. A real
difference after the Where is still the first divergence."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from debug_models import conv_1x1_qdq
from onnx import helper, numpy_helper

import quantbridge as qb

S_FINE = 0.05  # 4x finer than the tie tensor's 0.2: its 1-step ties are 4 steps here


def _then(model: onnx.ModelProto, case: str, add: float = 0.0) -> onnx.ModelProto:
    """The tie model (``conv_1x1_qdq``: a tie at every odd input code), then ``case`` of its
    output, ``+ add``, requantized on ``S_FINE``."""
    out = model.graph.output[0].name
    c = {"zero": np.float32(0), "add": np.float32(add), "lo": np.float32(0.3),
         "hi": np.float32(5.0), "idx": np.array([5, 0, 1], np.int64),
         "s_fine": np.float32(S_FINE), "z_fine": np.uint8(0)}  # fmt: skip
    nodes = {
        "where": [helper.make_node("IsNaN", [out], ["nan"]),
                  helper.make_node("Where", ["nan", "zero", out], ["sel"], name="node_where")],
        "where_transpose": [
            helper.make_node("IsNaN", [out], ["nan"]),
            helper.make_node("Where", ["nan", "zero", out], ["wh"], name="node_where"),
            helper.make_node("Transpose", ["wh"], ["sel"], perm=[0, 1, 3, 2])],
        "max": [helper.make_node("Max", [out, "lo"], ["sel"])],
        "clip": [helper.make_node("Clip", [out, "lo", "hi"], ["sel"])],
        "gather": [helper.make_node("Gather", [out, "idx"], ["sel"], axis=3)],
    }[case]  # fmt: skip
    model.graph.node.extend([
        *nodes,
        helper.make_node("Add", ["sel", "add"], ["f"]),
        helper.make_node("QuantizeLinear", ["f", "s_fine", "z_fine"], ["fq"], name="fine"),
        helper.make_node("DequantizeLinear", ["fq", "s_fine", "z_fine"], ["fine_out"]),
    ])  # fmt: skip
    used = {t for n in model.graph.node for t in n.input}
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in c.items() if k in used)
    model.graph.output[0].CopyFrom(
        helper.make_tensor_value_info(
            "fine_out", onnx.TensorProto.FLOAT, [1, 1, 8, 3 if case == "gather" else 8]
        )
    )
    onnx.checker.check_model(model, full_check=True)
    return model


X = np.arange(64, dtype=np.float32).reshape(1, 1, 8, 8) * np.float32(0.1)


def _files(case: str, add: float = 0.0):
    """Two files on ort-ref: b's tie conv weight scale is 1 + 1e-6, so b rounds every tie up
    and a (half to even) half of them down: 1-step differences of 0.2 on the tie tensor."""
    a = _then(conv_1x1_qdq(0.1, 1.0, 0.2, shape=(1, 1, 8, 8)), case)
    b = _then(conv_1x1_qdq(0.1, 1.000001, 0.2, shape=(1, 1, 8, 8)), case, add=add)
    return qb.compare(a, b, inputs={"x": X})


@pytest.mark.parametrize("case", ["where", "where_transpose", "max", "clip", "gather"])
def test_a_tie_carried_through_a_selection_is_rounding(case):
    r = _files(case)
    assert r.errors == {} and r.unmatched == {}
    by_name = {t["name"]: t["pairs"][0] for t in r.tensors}
    assert by_name["yq"]["max_lsb"] == pytest.approx(1.0)  # the premise: a 1-step tie upstream
    fine = by_name["fq"]
    assert fine["max_lsb"] == pytest.approx(4, rel=1e-4), fine  # the premise: 4 fine steps
    # each op selects one of its site's values (or a constant) per element: slope 1, so the
    # credit is the tie's one step of 0.2 in steps of 0.05 (float32 evaluation: 1e-4)
    assert fine["carried_lsb"] == pytest.approx(0.2 / S_FINE, rel=1e-4)
    assert fine["class"] == "rounding", fine
    assert r.first_divergence is None


def test_a_real_difference_after_a_where_is_still_the_first_divergence():
    # as above, and b adds 0.1 after the Where: 0.2 + 0.1 = 6 steps of 0.05 at the ties that
    # a rounded down, beyond the 4 carried + 1
    r = _files("where", add=0.1)
    by_name = {t["name"]: t["pairs"][0] for t in r.tensors}
    assert by_name["yq"]["class"] == "rounding" and by_name["yq"]["max_lsb"] == pytest.approx(1)
    fine = by_name["fq"]
    assert fine["carried_lsb"] == pytest.approx(4, rel=1e-4)  # the credit applies ...
    assert fine["max_lsb"] == pytest.approx(6, rel=1e-4)
    assert fine["class"] == "divergence", fine  # ... and is not enough
    assert r.first_divergence is not None and r.first_divergence["name"] == "fq"
