"""Integer softmax and layer norm on hand-built QDQ graphs (``kernels._normalize``): each
pattern against ONNX Runtime running the QDQ graph node by node (float softmax / layer norm),
the C and integer-ONNX emitters bit-exact with the numpy executor, and the refusals."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import quantbridge as qb


def _ort_reference(model) -> ort.InferenceSession:
    """ORT node by node (graph optimizations off): the QDQ semantics, float softmax / norm."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _softmax_then_q(g):
    """DequantizeLinear -> Softmax -> QuantizeLinear (uint8, scale 1/256: TFLite's grid)."""
    return g.quant(g.node("Softmax", [g.x], axis=-1), 1 / 256, 0)


def _scaled_softmax_matmul(g):
    """Attention: DQ(scores) * c -> Softmax (float) -> MatMul with DQ(values) -> Q."""
    probs = g.node("Softmax", [g.node("Mul", [g.x, g.const(np.float32(0.35))])])
    values = g.quant(g.node("Relu", [g.node("Transpose", [g.x], perm=[0, 2, 1])]), 0.04, 0)
    return g.quant(g.node("MatMul", [probs, values]), 0.02, 128)


def _layernorm(axis: int):
    def build(g):
        dims = (6, 8)[axis:] if axis == -1 else (6, 8)
        gamma = g.const(g.rng.uniform(-1.5, 1.5, dims).astype(np.float32))
        beta = g.const(g.rng.uniform(-0.5, 0.5, dims).astype(np.float32))
        ln = g.node("LayerNormalization", [g.x, gamma, beta], axis=axis, epsilon=1e-3)
        return g.quant(ln, 0.025, 0, np.int8)

    return build


def _layernorm_relu(g):
    ln = g.node("LayerNormalization", [g.x, g.const(np.full(8, 0.7, np.float32))])
    return g.quant(g.node("Relu", [ln]), 0.01, 0)


CASES = {
    "softmax_q": _softmax_then_q,
    "scaled_softmax_matmul": _scaled_softmax_matmul,
    "layernorm_last": _layernorm(-1),
    "layernorm_two_axes": _layernorm(-2),
    "layernorm_relu": _layernorm_relu,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_normalizations_agree_with_ort_and_emitters(name, qdq_graph, run_c, tmp_path):
    """One layer on the program's own input codes: the integer softmax / layer norm are within
    1 LSB of ORT's float ones (their approximation errors, ``kernels._normalize``, are far below
    half a code; a float tie moves a code by 1), >= 97% exact."""
    g = qdq_graph((3, 6, 8), scale=0.0437, zero=120)
    model = g.model(CASES[name](g))
    prog = qb.lower(model)
    x = (np.random.default_rng(0).standard_normal((3, 6, 8)) * 2).astype(np.float32)
    got = prog.run({"x": x}, integer=True)
    out = prog.outputs[0]
    ref = _ort_reference(model).run(None, {"x": x})[0]
    lsb = np.abs(
        got[out.name].astype(np.int64) - (np.rint(ref / out.tensor.scale) + out.tensor.zero_point)
    )
    assert lsb.max() <= 1 and (lsb == 0).mean() >= 0.97, (name, lsb.max(), (lsb == 0).mean())
    np.testing.assert_array_equal(run_c(prog, {"x": x}, tmp_path / "c")[out.name], got[out.name])
    prog.save_onnx(tmp_path / "int.onnx", {"x": x.shape})
    sess = ort.InferenceSession(str(tmp_path / "int.onnx"), providers=["CPUExecutionProvider"])
    codes = prog.run_integer({"x": x})[prog.inputs[0].tensor.name]
    np.testing.assert_array_equal(sess.run(None, {prog.inputs[0].tensor.name: codes})[0],
                                  got[out.name])  # fmt: skip


def test_softmax_of_a_constant_row_is_uniform(qdq_graph):
    g = qdq_graph((2, 8), scale=0.1, zero=0, dtype=np.int8)
    prog = qb.lower(g.model(_softmax_then_q(g)))
    got = prog.run({"x": np.full((2, 8), 0.3, np.float32)}, integer=True)
    assert (next(iter(got.values())) == 32).all()  # 1/8 on the 1/256 grid


def test_refusals_name_the_node_and_the_fix(qdq_graph):
    # a softmax over axis 1 of a rank-3 tensor is lowered since 2026-12-02 (ConvBERT):
    # tests/integer/test_integer_more_ops.py
    g = qdq_graph((2, 4, 8))
    old_default = g.model(g.quant(g.node("Softmax", [g.x]), 1 / 256, 0))
    old_default.opset_import[0].version = 12  # default axis 1: softmax over the flattened 4 x 8
    with pytest.raises(qb.LoweringError, match="axis 1 of a rank-3"):
        qb.lower(old_default)
    g = qdq_graph((2, 8))
    curved = g.node("Softmax", [g.node("Sigmoid", [g.x])])
    with pytest.raises(qb.LoweringError, match="non-linear or decreasing"):
        qb.lower(g.model(g.quant(curved, 1 / 256, 0)))
    g = qdq_graph((2, 8))
    # an unquantized function of x plus another tensor (a quantized sum of two tensors lowers:
    # test_integer_mha_scores.test_scores_plus_a_position_bias)
    mask = g.quant(g.node("Relu", [g.x]), 0.05, 0)
    half = g.node("Mul", [g.x, g.const(np.float32(0.5))])
    masked = g.node("Softmax", [g.node("Add", [half, mask])])
    # the refusal names the float operand, why (no QuantizeLinear before the Add) and the fix
    with pytest.raises(qb.LoweringError, match="Add .*its input .* is a float value .*no Quant"):
        qb.lower(g.model(g.quant(masked, 1 / 256, 0)))
    # a float result with no bound read by an op that needs codes (a SumPending was a KeyError;
    # a mean of a bounded sum now lowers: test_integer_float_averages)
    g = qdq_graph((2, 4, 8))
    product = g.node("MatMul", [g.x, g.weight((8, 8), axis=1)])
    pooled = g.node("ReduceMean", [product, g.const(np.array([-1], np.int64))])
    with pytest.raises(qb.LoweringError, match="ReduceMean .*unquantized float result"):
        qb.lower(g.model(g.quant(pooled, 0.05, 128)))


def test_long_attention_keeps_an_int32_accumulator(qdq_graph, layerwise, run_c, tmp_path):
    """512 tokens: ``K * 2**15 * 255`` would exceed int32, but a row of probabilities sums to at
    most ``2**15 + K/2``, so probs @ values is bounded by ``(2**15 + 256) * 255``. Layer by
    layer (ORT fed the program's scores) within 1 LSB, measured 98.7% exact; end to end a
    score code flipped by a float tie moves a few outputs by 2, so that is not the check."""
    g = qdq_graph((1, 512, 8), scale=0.05, zero=128)
    scores = g.quant(g.node("MatMul", [g.x, g.node("Transpose", [g.x], perm=[0, 2, 1])]), 0.1, 128)
    attended = g.node("MatMul", [g.node("Softmax", [scores]), g.x])
    model = g.model(g.quant(attended, 0.02, 128))
    prog = qb.lower(model)  # int32 accumulators
    step = next(s for s in prog.steps if s.op == "matmul" and s.inputs[0].startswith("softmax"))
    assert step.attrs["bound"] == (2**15 + 256) * 128
    x = np.random.default_rng(3).standard_normal((1, 512, 8)).astype(np.float32)
    for lsb in layerwise(model, prog, {"x": x}).values():
        assert lsb.max() <= 1 and (lsb == 0).mean() >= 0.97
    got = prog.run({"x": x}, integer=True)
    out = prog.outputs[0].name
    np.testing.assert_array_equal(run_c(prog, {"x": x}, tmp_path)[out], got[out])


def test_sdpa_style_patterns(qdq_graph, run_c, tmp_path):
    """What ``scaled_dot_product_attention`` and ``nn.MultiheadAttention`` exports write around
    the scores: a float input transposed before its QuantizeLinear, Gather of q / k with a
    constant index, and both MatMul operands multiplied by ``sqrt(scale)`` (folded into the
    accumulator scale). Within 1 LSB of ORT; C and integer ONNX bit-exact."""
    g = qdq_graph((4, 2, 8))
    g.nodes, g.inits = [], []  # the input is transposed before it is quantized
    q = g.quant(g.node("Transpose", ["x"], perm=[1, 0, 2]), 0.05, 128)
    half = g.const(np.float32(0.5))
    first = g.node("Mul", [g.node("Gather", [q, g.const(np.int64(0))], axis=0), half])
    second = g.node("Gather", [q, g.const(np.int64(-1))], axis=0)
    keys = g.node("Mul", [g.node("Transpose", [second], perm=[1, 0]), half])
    model = g.model(g.quant(g.node("MatMul", [first, keys]), 0.03, 128))
    prog = qb.lower(model)
    assert prog.op_counts()["gather"] == 2
    x = np.random.default_rng(4).standard_normal((4, 2, 8)).astype(np.float32)
    got = prog.run({"x": x}, integer=True)
    out = prog.outputs[0]
    ref = _ort_reference(model).run(None, {"x": x})[0]
    lsb = np.abs(got[out.name] - (np.rint(ref / out.tensor.scale) + out.tensor.zero_point))
    assert lsb.max() <= 1 and (lsb == 0).mean() >= 0.9
    np.testing.assert_array_equal(run_c(prog, {"x": x}, tmp_path)[out.name], got[out.name])
    prog.save_onnx(tmp_path / "int.onnx", {"x": x.shape})
    sess = ort.InferenceSession(str(tmp_path / "int.onnx"), providers=["CPUExecutionProvider"])
    codes = prog.run_integer({"x": x})[prog.inputs[0].tensor.name]
    np.testing.assert_array_equal(sess.run(None, {prog.inputs[0].tensor.name: codes})[0],
                                  got[out.name])  # fmt: skip


def test_layer_norm_of_a_float_residual_sum(qdq_graph, layerwise, three_emitters, tmp_path):
    """Pre-LN transformers (CLIP, SegFormer) and ConvNeXt normalize ``x + f(x)`` that no
    QuantizeLinear follows; before: "LayerNormalization: its input is an unquantized float
    result" (2026-12-02). The sum is realized on an int16 grid of its bound / 32767 (here
    (0.05 + 0.08) x 128 / 32767 = 5e-4, half of it per element, against a spread of ~2), then
    the integer layer norm: within 1 LSB of ORT."""
    g = qdq_graph((2, 4, 8), scale=0.05, zero=128)
    residual = g.quant(g.node("MatMul", [g.x, g.weight((8, 8), axis=1)]), 0.08, 128)
    total = g.node("Add", [g.x, residual])
    gamma = g.const(g.rng.uniform(0.5, 1.5, 8).astype(np.float32))
    beta = g.const(g.rng.normal(0, 0.2, 8).astype(np.float32))
    model = g.model(g.quant(g.node("LayerNormalization", [total, gamma, beta]), 0.03, 128))
    feeds = {"x": np.random.default_rng(4).normal(0, 2, (2, 4, 8)).astype(np.float32)}
    prog = qb.lower(model)
    assert {"rescale_sum", "layernorm"} <= set(prog.op_counts())
    diffs = layerwise(model, prog, feeds)
    assert len(diffs) == 2 and max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)


def test_layer_scale_is_an_integer_mul(qdq_graph, layerwise, three_emitters, tmp_path):
    """ConvNeXt's layer scale ``gamma * x`` (a float per-channel constant the default recipe
    leaves float); before: "Mul: operands must be quantized tensors" (HF ConvNeXt, 2026-12-02).
    gamma goes on a symmetric int16 grid of max |gamma| / 32767: the product is off by at most
    max |x| max |gamma| / 65534, 0.004 of an output step spanning that range: within 1 LSB."""
    g = qdq_graph((2, 4, 8), scale=0.05, zero=128)
    gamma = g.const(g.rng.uniform(-1.0, 1.0, 8).astype(np.float32))
    model = g.model(g.quant(g.node("Mul", [g.x, gamma]), 0.05, 128))
    feeds = {"x": np.random.default_rng(4).normal(0, 2, (2, 4, 8)).astype(np.float32)}
    prog = qb.lower(model)
    assert set(prog.op_counts()) == {"mul"}
    diffs = layerwise(model, prog, feeds)
    assert len(diffs) == 1 and max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)


def test_rms_norm_lowers(qdq_graph, layerwise, three_emitters, tmp_path):
    """Llama / T5's RMSNorm as exported: ``Pow(x, 2) -> ReduceMean(-1) -> Add(eps) -> Sqrt ->
    Reciprocal -> Q``, then ``x * r`` and ``* weight`` (float per channel). Before: "no integer
    lowering: Reciprocal" (HF Llama, T5, 2026-12-02). The row's code of ``rsqrt`` is read off
    integer thresholds of ``S2 = sum (q - z)**2`` (exact against float64); ORT's float32 chain
    can round across a step: within 1 LSB at every quantized tensor."""
    g = qdq_graph((2, 4, 8), scale=0.05, zero=128)
    mean = g.node("ReduceMean", [g.node("Pow", [g.x, g.const(np.float32(2))]),
                                 g.const(np.array([-1], np.int64))], keepdims=1)  # fmt: skip
    root = g.node("Sqrt", [g.node("Add", [mean, g.const(np.float32(1e-6))])])
    inverse = g.quant(g.node("Reciprocal", [root]), 0.02, 0)
    normalized = g.quant(g.node("Mul", [g.x, inverse]), 0.02, 128)
    weight = g.const(g.rng.uniform(0.5, 1.5, 8).astype(np.float32))
    model = g.model(g.quant(g.node("Mul", [weight, normalized]), 0.03, 128))
    feeds = {"x": np.random.default_rng(6).normal(0, 1.5, (2, 4, 8)).astype(np.float32)}
    prog = qb.lower(model)
    assert {"row_squares", "mul"} == set(prog.op_counts())
    diffs = layerwise(model, prog, feeds)
    assert len(diffs) == 3 and max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)


def _group_norm(g, groups: int, act: str):
    """torch's ``nn.GroupNorm(groups, C)`` as exported: ``Reshape(N, G, -1) ->
    InstanceNormalization(ones, zeros) -> Reshape(N, C, H, W) -> Mul(gamma) -> Add(beta)``,
    then (UNet blocks) ``x * Sigmoid(x)`` or (wav2vec2's feature extractor) the exact GELU
    ``x * (1 + erf(x / sqrt 2)) * 0.5``, with no QuantizeLinear in between."""
    n, c, h, w = 2, 6, 4, 5
    rows = g.node("Reshape", [g.x, g.const(np.array([n, groups, -1], np.int64))])
    ones, zeros = np.ones(groups, np.float32), np.zeros(groups, np.float32)
    norm = g.node("InstanceNormalization", [rows, g.const(ones), g.const(zeros)], epsilon=1e-5)
    back = g.node("Reshape", [norm, g.const(np.array([n, c, h, w], np.int64))])
    gamma = g.rng.uniform(0.5, 1.5, (c, 1, 1)).astype(np.float32)
    beta = g.rng.normal(0, 0.3, (c, 1, 1)).astype(np.float32)
    y = g.node("Add", [g.node("Mul", [back, g.const(gamma)]), g.const(beta)])
    if act == "silu":
        y = g.node("Mul", [y, g.node("Sigmoid", [y])])
    if act == "gelu":
        erf = g.node("Erf", [g.node("Div", [y, g.const(np.float32(np.sqrt(2)))])])
        y = g.node("Mul", [g.node("Mul", [y, g.node("Add", [erf, g.const(np.float32(1))])]),
                           g.const(np.float32(0.5))])  # fmt: skip
    return g.quant(y, 0.03, 20 if act else 128)


@pytest.mark.parametrize("act", ["", "silu", "gelu"])
def test_group_norm_lowers(act, qdq_graph, layerwise, three_emitters, tmp_path):
    """GroupNorm (UNet / diffusion blocks, WavLM's feature extractor, PoolFormer); before: "no
    integer lowering: InstanceNormalization" (2026-12-02). One layer norm step per group row
    with the per-channel gamma / beta folded in (one rounding at the QuantizeLinear, as the
    LayerNormalization test: within 1 LSB of ORT's float32). With a SiLU / GELU, the value
    is first realized on int16 codes of step bound / 32767 (here bound = 1.5 sqrt(40) + 0.9,
    step 3e-4, half of it per element: 0.005 of the 0.03 output step), then a 65536-entry
    table: still within 1 LSB."""
    g = qdq_graph((2, 6, 4, 5), scale=0.05, zero=128)
    model = g.model(_group_norm(g, 3, act))
    feeds = {"x": np.random.default_rng(7).normal(0, 2, (2, 6, 4, 5)).astype(np.float32)}
    prog = qb.lower(model)
    assert {"layernorm", "reshape"} <= set(prog.op_counts())
    assert ("lut" in prog.op_counts()) == bool(act)
    diffs = layerwise(model, prog, feeds)
    assert len(diffs) == 1 and max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)


def test_instance_norm_with_a_per_channel_affine(qdq_graph, layerwise, three_emitters, tmp_path):
    """``nn.InstanceNorm2d(affine=True)``: rows of H W codes, scale / bias per channel in the
    layer norm step's multipliers (a period of C rows): within 1 LSB of ORT."""
    g = qdq_graph((2, 3, 4, 4), scale=0.05, zero=128)
    scale = g.const(g.rng.uniform(-1.5, 1.5, 3).astype(np.float32))
    bias = g.const(g.rng.normal(0, 0.3, 3).astype(np.float32))
    model = g.model(g.quant(g.node("InstanceNormalization", [g.x, scale, bias]), 0.03, 128))
    feeds = {"x": np.random.default_rng(8).normal(0, 2, (2, 3, 4, 4)).astype(np.float32)}
    prog = qb.lower(model)
    assert set(prog.op_counts()) == {"layernorm"}
    diffs = layerwise(model, prog, feeds)
    assert len(diffs) == 1 and max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)


def test_group_norm_after_a_reshape_to_a_computed_shape(qdq_graph, layerwise):
    """torch writes ``Reshape(x, Shape(...))`` for a GroupNorm's reshape back; ONNX shape
    inference without data propagation leaves every tensor after it without static dims, and a
    second GroupNorm was refused ("the input shape must be static", a UNet block, 2026-12-02).
    ``lower`` now infers shapes with ``data_prop``: the next group norm lowers, within 1 LSB."""
    g = qdq_graph((2, 6, 4, 5), scale=0.05, zero=128)
    same = g.quant(g.node("Reshape", [g.x, g.node("Shape", [g.x])]), 0.05, 128)
    rows = g.node("Reshape", [same, g.const(np.array([2, 3, -1], np.int64))])
    ones, zeros = g.const(np.ones(3, np.float32)), g.const(np.zeros(3, np.float32))
    norm = g.node("InstanceNormalization", [rows, ones, zeros])
    back = g.node("Reshape", [norm, g.node("Shape", [same])])
    model = g.model(g.quant(back, 0.03, 128))
    feeds = {"x": np.random.default_rng(7).normal(0, 2, (2, 6, 4, 5)).astype(np.float32)}
    prog = qb.lower(model)
    assert "layernorm" in prog.op_counts()
    diffs = layerwise(model, prog, feeds)
    assert max(int(d.max()) for d in diffs.values()) <= 1


def test_poolformer_token_mixer(qdq_graph, layerwise, three_emitters, tmp_path):
    """PoolFormer: ``n = GroupNorm(1, C)(x); pool(n) - n`` with no QuantizeLinear between;
    before: "AveragePool: its input is an unquantized float result" (HF PoolFormer,
    2026-12-02). ``n`` goes on int16 codes of bound / 32767 (<= 4.6e-4 here: 1.5 sqrt(100) +
    0.1 = 15.1); the 3x3 mean of those
    codes on its int16 grid too (the integer ONNX sums int16 codes as two exact byte sums);
    then the difference's one rounding at the QuantizeLinear: within 1 LSB of ORT."""
    g = qdq_graph((2, 4, 5, 5), scale=0.05, zero=128)
    rows = g.node("Reshape", [g.x, g.const(np.array([2, 1, -1], np.int64))])
    one, zero = g.const(np.ones(1, np.float32)), g.const(np.zeros(1, np.float32))
    norm = g.node("InstanceNormalization", [rows, one, zero])
    back = g.node("Reshape", [norm, g.const(np.array([2, 4, 5, 5], np.int64))])
    gamma = g.rng.uniform(0.5, 1.5, (4, 1, 1)).astype(np.float32)
    n = g.node("Add", [g.node("Mul", [back, g.const(gamma)]), g.const(np.float32(0.1))])
    pool = g.node("AveragePool", [n], kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=0)
    model = g.model(g.quant(g.node("Sub", [pool, n]), 0.03, 128))
    feeds = {"x": np.random.default_rng(7).normal(0, 2, (2, 4, 5, 5)).astype(np.float32)}
    prog = qb.lower(model)
    assert {"layernorm", "avgpool", "rescale_sum"} <= set(prog.op_counts())
    diffs = layerwise(model, prog, feeds)
    assert len(diffs) == 1 and max(int(d.max()) for d in diffs.values()) <= 1
    three_emitters(prog, feeds, tmp_path)
