"""Integer / bool mask and id arithmetic (``lowering._index``): the attention-mask path of
transformers' text models (int64 mask -> Cast bool -> GatherND / Unsqueeze -> And / Not ->
Where(mask, fill, scores) -> Softmax), id comparisons, CumSum, and the embedding lookup by
run-time token ids. Integer results are exact against ONNX Runtime; the three emitters agree."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import quantbridge as qb

SHAPE = (2, 1, 6, 6)  # scores (batch, heads, queries, keys)


def _mask_graph(qdq_graph, fill=float("-inf")):
    g = qdq_graph(SHAPE, scale=0.1, zero=128)
    for name in ("ids", "mask"):
        g.inputs.append(helper.make_tensor_value_info(name, TensorProto.INT64, [2, 6]))
    mask = g.node("Cast", ["mask"], to=TensorProto.BOOL)
    # transformers' sdpa mask: GatherND of the bool mask at (batch, key), And with the causal
    # (here: all-true) constant, Not, Where(not_mask, fill, scores)
    index = np.stack(np.meshgrid(np.arange(2), np.arange(6), indexing="ij"), -1)
    picked = g.node("GatherND", [mask, g.const(index.reshape(2, 1, 1, 6, 2))])
    keep = g.node("And", [g.const(np.ones((1, 1, 6, 1), bool)), picked])
    scores = g.node("Where", [g.node("Not", [keep]), g.const(np.float32(fill)), g.x])
    probs = g.quant(g.node("Softmax", [scores], axis=-1), 1 / 256, 0)
    table = g.rng.normal(0, 1, (50, 4)).astype(np.float32)
    embedded = g.quant(g.node("Gather", [g.const(table), "ids"], axis=0), 0.02, 0, np.int8)
    ids = g.node("Where", [g.node("Or", [g.node("Equal", ["ids", g.const(np.int64(0))]),
                                         g.node("Less", ["ids", g.const(np.int64(10))])]),
                           g.const(np.int64(-1)), "ids"])  # fmt: skip
    small = g.node("Cast", [ids], to=TensorProto.INT32)
    positions = g.node("CumSum", ["mask", g.const(np.int64(1))], exclusive=1, reverse=1)
    # RoBERTa's position ids: cumsum(mask) * mask + padding_idx
    roberta = g.node("Add", [g.node("Mul", [g.node("CumSum", ["mask", g.const(np.int64(1))]),
                                            "mask"]), g.const(np.int64(1))])  # fmt: skip
    model = g.model(probs, embedded)
    for name, dtype in ((keep, TensorProto.BOOL), (small, TensorProto.INT32),
                        (positions, TensorProto.INT64), (roberta, TensorProto.INT64)):  # fmt: skip
        model.graph.output.append(helper.make_tensor_value_info(name, dtype, None))
    return model


def _feeds(full_row: bool):
    rng = np.random.default_rng(4)
    mask = np.ones((2, 6), np.int64)
    mask[1, 4:] = 0
    if full_row:
        mask[1] = 0  # a batch row with every key masked
    return {
        "x": rng.normal(0, 3, SHAPE).astype(np.float32),
        "ids": rng.integers(0, 50, (2, 6)).astype(np.int64),  # token ids (0 and < 10: compared)
        "mask": mask,
    }


@pytest.mark.parametrize(("fill", "full_row"), [(float("-inf"), False),
                                                (float(np.finfo(np.float32).min), True)])  # fmt: skip
def test_mask_and_id_arithmetic_match_ort(qdq_graph, layerwise, three_emitters, tmp_path, fill,
                                          full_row):  # fmt: skip
    """Integer outputs and the embedding codes exact; the masked softmax within 1 LSB (its
    int16 probabilities round once more than ORT's float ones). A fully masked row is uniform,
    as float32 gives for transformers' finfo.min fill (-inf gives NaN there: not tested)."""
    model = _mask_graph(qdq_graph, fill)
    feeds = _feeds(full_row)
    prog = qb.lower(model)
    assert {
        "softmax",
        "take",
        "gather_nd",
        "logic",
        "compare",
        "where",
        "cast",
        "cumsum",
        "arith",
    } <= set(prog.op_counts())
    got = prog.run(feeds)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    ref = dict(zip(names, sess.run(None, feeds), strict=True))
    for name in names[2:]:  # bools come out as uint8 0 / 1
        np.testing.assert_array_equal(got[name], ref[name].astype(got[name].dtype), err_msg=name)
    diffs = layerwise(model, prog, feeds)
    producer = {n.output[0]: n for n in model.graph.node}
    embedded_codes = producer[names[1]].input[0]  # the embedding's QuantizeLinear output
    assert len(diffs) == 2 and int(diffs[embedded_codes].max()) == 0
    assert max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)


def test_other_fills_name_the_fix(qdq_graph):
    g = qdq_graph(SHAPE)
    g.inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 1, 1, 6]))
    scores = g.node("Where", ["mask", g.const(np.float32(-5.0)), g.x])
    model = g.model(g.quant(g.node("Softmax", [scores]), 1 / 256, 0))
    with pytest.raises(qb.LoweringError, match=r"Where .*selects float values.*-inf"):
        qb.lower(model)


@pytest.mark.parametrize("mask_first", [False, True])
def test_eager_additive_mask_matches_ort(qdq_graph, layerwise, three_emitters, tmp_path,
                                         mask_first):  # fmt: skip
    """transformers' eager attention: ``scores + Where(keep, 0, finfo.min)`` -> Softmax. Before,
    "Add: operands must be quantized tensors" (HF BERT with attn_implementation="eager",
    2026-12-02). float32 absorbs every finite score into finfo.min, so a masked key has weight
    exactly 0, as in the Where form: within 1 LSB of ORT (int16 probabilities round once more),
    a fully masked row uniform in both."""
    g = qdq_graph(SHAPE, scale=0.1, zero=128)
    g.inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT64, [2, 6]))
    keep = g.node("Unsqueeze", [g.node("Cast", ["mask"], to=TensorProto.BOOL),
                                g.const(np.array([1, 2], np.int64))])  # fmt: skip
    fill = g.const(np.float32(np.finfo(np.float32).min))
    additive = g.node("Where", [keep, g.const(np.float32(0)), fill])
    scores = g.node("Add", [additive, g.x] if mask_first else [g.x, additive])
    model = g.model(g.quant(g.node("Softmax", [scores], axis=-1), 1 / 256, 0))
    feeds = {k: v for k, v in _feeds(full_row=True).items() if k != "ids"}
    prog = qb.lower(model)
    assert {"softmax", "cast"} <= set(prog.op_counts())
    diffs = layerwise(model, prog, feeds)
    assert len(diffs) == 1 and max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)


def test_mask_made_float_and_quantized(qdq_graph, layerwise, three_emitters, tmp_path):
    """DeBERTa's embeddings: ``embeddings * mask.unsqueeze(2).to(float)``, the float mask
    quantized like any activation, and a reshape whose shape is a product of constants
    (``size * constant``). Before: "Cast ... to FLOAT: only casts between integer / bool types",
    then "Mul: operands must be quantized tensors" (HF DeBERTa-v2, 2026-12-02). The mask's
    integers are requantized to its grid (``rescale_sum``: 1 / (1/255) = 255 in fixed point,
    exact for 0 / 1), the Mul is the integer ``mul``: within 1 LSB of ORT (one rounding each)."""
    g = qdq_graph((2, 6, 4), scale=0.05, zero=128)
    g.inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT64, [2, 6]))
    mask = g.node("Cast", [g.node("Unsqueeze", ["mask", g.const(np.array([2], np.int64))])],
                  to=TensorProto.FLOAT)  # fmt: skip
    product = g.quant(g.node("Mul", [g.x, g.quant(mask, 1 / 255, 0)]), 0.05, 128)
    shape = g.node(
        "Mul", [g.const(np.array([2, 12], np.int64)), g.const(np.array([1, 2], np.int64))]
    )
    model = g.model(g.node("Reshape", [product, shape]))
    feeds = {k: v for k, v in _feeds(full_row=False).items() if k == "mask"}
    feeds["x"] = np.random.default_rng(5).normal(0, 2, (2, 6, 4)).astype(np.float32)
    prog = qb.lower(model)
    assert {"mul", "rescale_sum", "unsqueeze"} <= set(prog.op_counts())
    diffs = layerwise(model, prog, feeds)
    assert len(diffs) == 2 and max(int(d.max()) for d in diffs.values()) <= 1
    (got,) = prog.run(feeds).values()
    assert got.shape == (2, 24) and np.all(got.reshape(2, 6, 4)[1, 4:] == 0)  # masked: 0
    three_emitters(prog, feeds, tmp_path)


def test_hand_written_additive_mask(qdq_graph, layerwise, three_emitters, tmp_path):
    """``scores / sqrt(d) + (1 - mask.float()) * finfo.min`` written by hand (older transformers,
    custom attention): the default recipe quantizes the float mask and its product with
    finfo.min (a grid of step 1.3e36 whose zero point is its top code). Before: refused at the
    Cast, then at the Add (2026-12-02). Every code but the zero point is a fill of at most
    -1.3e36, so ``keep = (q == z)`` and the masked softmax applies: within 1 LSB of ORT."""
    g = qdq_graph(SHAPE, scale=0.1, zero=128)
    g.inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT64, [2, 6]))
    axes = g.const(np.array([1, 2], np.int64))
    mask = g.node("Cast", [g.node("Unsqueeze", ["mask", axes])], to=TensorProto.FLOAT)
    inverted = g.quant(g.node("Sub", [g.const(np.float32(1)), mask]), 1 / 255, 0)
    scale = np.float32(np.finfo(np.float32).max / 255)
    fill = g.node("DequantizeLinear", [g.const(np.uint8(0)), g.const(scale),
                                       g.const(np.uint8(255))])  # fmt: skip
    additive = g.quant(g.node("Mul", [inverted, fill]), scale, 255)
    scores = g.node("Add", [g.node("Mul", [g.x, g.const(np.float32(0.5))]), additive])
    model = g.model(g.quant(g.node("Softmax", [scores], axis=-1), 1 / 256, 0))
    feeds = {k: v for k, v in _feeds(full_row=False).items() if k != "ids"}
    prog = qb.lower(model)
    assert {"softmax", "compare", "arith"} <= set(prog.op_counts())
    diffs = layerwise(model, prog, feeds)
    assert max(int(d.max()) for d in diffs.values()) <= 1
    (got,) = prog.run(feeds).values()
    assert np.all(got[1, ..., 4:] == 0)  # masked keys: weight 0
    three_emitters(prog, feeds, tmp_path)


def test_constant_causal_mask(qdq_graph, layerwise, three_emitters, tmp_path):
    """A decoder run without an attention_mask (HF Llama with static shapes): the causal mask
    folds to a constant, ``Where(future, finfo.min, scores)``. Before: "a constant mask is not
    lowered" (2026-12-02). The keep mask is a program constant: within 1 LSB of ORT."""
    g = qdq_graph(SHAPE, scale=0.1, zero=128)
    future = np.triu(np.ones((6, 6), bool), 1)[None, None]
    fill = g.const(np.float32(np.finfo(np.float32).min))
    scores = g.node("Where", [g.const(future), fill, g.x])
    model = g.model(g.quant(g.node("Softmax", [scores], axis=-1), 1 / 256, 0))
    feeds = {"x": _feeds(full_row=False)["x"]}
    prog = qb.lower(model)
    assert set(prog.op_counts()) == {"softmax", "rescale_sum"}  # probabilities to uint8
    diffs = layerwise(model, prog, feeds)
    assert max(int(d.max()) for d in diffs.values()) <= 1
    (got,) = prog.run(feeds).values()
    assert np.all(got[..., future[0, 0]] == 0)  # no weight on a future key
    three_emitters(prog, feeds, tmp_path)


def test_position_bias_under_a_mask(qdq_graph, layerwise, three_emitters, tmp_path):
    """T5: ``scores + Where(keep, position_bias, finfo.min)`` -> Softmax (the mask and the
    relative position bias combined first). Before: "Add: operands must be quantized tensors"
    (HF T5 encoder, 2026-12-02). The kept scores get the bias on the int16 score grid
    (``test_scores_plus_a_position_bias``), the masked ones weight 0: within 1 LSB of ORT."""
    g = qdq_graph(SHAPE, scale=0.1, zero=128)
    g.inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT64, [2, 6]))
    keep = g.node("Unsqueeze", [g.node("Cast", ["mask"], to=TensorProto.BOOL),
                                g.const(np.array([1, 2], np.int64))])  # fmt: skip
    bias = g.const(g.rng.normal(0, 1, (1, 1, 6, 6)).astype(np.float32))
    fill = g.const(np.float32(np.finfo(np.float32).min))
    scores = g.node("Add", [g.x, g.node("Where", [keep, bias, fill])])
    model = g.model(g.quant(g.node("Softmax", [scores], axis=-1), 1 / 256, 0))
    feeds = {k: v for k, v in _feeds(full_row=False).items() if k != "ids"}
    prog = qb.lower(model)
    assert {"softmax", "rescale_sum", "cast"} <= set(prog.op_counts())
    diffs = layerwise(model, prog, feeds)
    assert max(int(d.max()) for d in diffs.values()) <= 1
    (got,) = prog.run(feeds).values()
    assert np.all(got[1, ..., 4:] == 0)  # masked keys: weight 0
    three_emitters(prog, feeds, tmp_path)


@pytest.mark.parametrize("last", [0, 1])
def test_argmax_pooling_at_the_eos_token(qdq_graph, layerwise, three_emitters, tmp_path, last):
    """CLIP's text pooling ``hidden[arange(B), ids.argmax(-1)]`` as torch exports it: ArgMax of
    the int64 ids, Unsqueeze, Concat with the (folded) Range, GatherND of the hidden codes by
    those run-time pairs; plus ArgMax / ArgMin over a quantized tensor's codes (a positive
    scale keeps the order of the real values, equal codes being equal values). Before: "no
    integer lowering: ArgMax" (HF CLIP text, 2026-12-02). All integer: the indices and the
    gathered codes equal ORT's exactly (0 LSB); ties (repeated ids, equal codes) pick the
    index ``select_last_index`` asks for."""
    g = qdq_graph((2, 6, 4), scale=0.05, zero=128)
    g.inputs.append(helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 6]))
    eos = g.node("ArgMax", ["ids"], axis=-1, keepdims=0, select_last_index=last)
    rows = g.node("Unsqueeze", [g.const(np.arange(2, dtype=np.int64)), g.const(np.array([-1]))])
    pairs = g.node("Concat", [rows, g.node("Unsqueeze", [eos, g.const(np.array([-1]))])], axis=-1)
    pooled = g.quant(g.node("GatherND", [g.x, pairs]), 0.05, 128)
    peak = g.node("ArgMax", [g.x], axis=1, keepdims=1, select_last_index=last)
    low = g.node("ArgMin", [g.x], axis=-1, keepdims=0, select_last_index=last)
    model = g.model(pooled)
    for name in (eos, peak, low):
        model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.INT64, None))
    rng = np.random.default_rng(9)
    ids = rng.integers(0, 5, (2, 6)).astype(np.int64)  # ids repeat: ties
    feeds = {"x": rng.normal(0, 0.3, (2, 6, 4)).astype(np.float32), "ids": ids}
    prog = qb.lower(model)
    assert {"arg_extreme", "int_concat", "take_nd"} <= set(prog.op_counts())
    got = prog.run(feeds)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    for name, ref in zip(names, sess.run(None, feeds), strict=True):
        np.testing.assert_array_equal(got[name], ref, err_msg=name)
    diffs = layerwise(model, prog, feeds)
    assert max(int(d.max()) for d in diffs.values()) == 0
    three_emitters(prog, feeds, tmp_path)


def test_argmax_of_a_float_result_names_the_fix(qdq_graph):
    g = qdq_graph((2, 6), scale=0.05, zero=128)
    logits = g.node("MatMul", [g.x, g.weight((6, 3), axis=1)])
    with pytest.raises(qb.LoweringError, match=r"ArgMax 'argmax_\d+': reads .*quantize_outputs"):
        qb.lower(g.model(g.node("ArgMax", [logits], axis=-1)))
