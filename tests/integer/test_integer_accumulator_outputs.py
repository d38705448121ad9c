"""A float graph output written by a weighted layer (``Recipe(quantize_outputs=False)``: logits
not rounded) lowers with ``float_outputs="dequantize"``: the program outputs the layer's int32
accumulator (bias included) and the output's ``Boundary.scale`` (float32, per tensor or per
channel) turns it into floats outside the program.

Tolerances, in units of the accumulator scale ``s_x * s_w[c]`` of each output channel, from
``S = sum_k |q_x - z_x| |q_w - z_w| + |q_b|`` (codes, per output element), ``u = 2**-24``:

* float64 recomputation of the layer from the file's integers and scales: the program's value
  is ``(acc + q_b) * float32(s_x s_w)`` rounded once to float32, so it is within
  ``u * S`` (the float32 scale) + ``u * S`` (the final rounding) of the exact value: ``2 u S``;
* ONNX Runtime node by node (optimizations off, every QuantizeLinear fed the program's own codes,
  so only the last layer differs): it computes the layer in float32 from dequantized operands
  (each rounded once to float32), the products and K-term sum in float32 (FMA or not, in any
  order): within ``gamma(K + 3) * S`` of exact, ``gamma(n) = n u / (1 - n u)``; with our
  ``2 u S`` the assertion is ``(gamma(K + 3) + 2 u) * S``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

import quantbridge as qb
from quantbridge.integer import load_npz, save_npz
from quantbridge.zoo import DigitsCNN, _randomize_bn

U = 2.0**-24


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """DigitsCNN (random weights, non-trivial BatchNorms) quantized with float logits."""
    torch.manual_seed(0)
    model = _randomize_bn(DigitsCNN()).eval()
    calib = [torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    recipe = dataclasses.replace(qb.Recipe.preset("native"), quantize_outputs=False)
    qmodel = qb.quantize(model, calib, recipe, progress=False)
    path = tmp_path_factory.mktemp("digits") / "digits_float_logits.onnx"
    x = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(7))
    qb.export(qmodel, path, example_inputs=x[:1])
    return qmodel, path, x


def _ort(model: onnx.ModelProto):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _ort_node_by_node(model: onnx.ModelProto, prog, feeds: dict) -> list[np.ndarray]:
    """ORT's float graph outputs with every inner QuantizeLinear output replaced by the program's
    codes (the graph cut there), so that only the layers after the last Q are compared."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    graph_inputs = {i.name for i in m.graph.input}
    env = prog.run_integer(feeds)
    cut = {}
    for n in m.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] not in graph_inputs:
            cut[n.output[0]] = env[prog.onnx_tensors[n.output[0]]]
            n.output[0] += "__cut"
    for name, codes in cut.items():
        dtype = onnx.helper.np_dtype_to_tensor_dtype(codes.dtype)
        m.graph.input.append(onnx.helper.make_tensor_value_info(name, dtype, codes.shape))
    sess = _ort(m)
    wanted = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in {**feeds, **cut}.items() if k in wanted})


def _last_gemm_float64(model: onnx.ModelProto, prog, feeds: dict):
    """The final Gemm of ``model`` recomputed in float64 from the file's integers and scales, on
    the program's own input codes: ``(exact, S, acc_scale)`` (module docstring)."""
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    gemm = producer[g.output[0].name]
    assert gemm.op_type == "Gemm"
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gemm.attribute}
    dq_x, dq_w, dq_b = (producer[i] for i in gemm.input)
    codes = prog.run_integer(feeds)[prog.onnx_tensors[dq_x.input[0]]].astype(np.int64)
    sx, zx = (np.float64(inits[n]) for n in dq_x.input[1:])
    wq, sw, zw = (inits[n].astype(np.float64) for n in dq_w.input)
    bq, sb = inits[dq_b.input[0]].astype(np.float64), inits[dq_b.input[1]].astype(np.float64)
    wc = wq - zw.reshape(-1, 1) if attrs.get("transB", 0) else (wq - zw).T  # (O, K)
    xc = codes - zx
    exact = (xc * sx) @ (wc * sw.reshape(-1, 1)).T + bq * sb
    s_abs = np.abs(xc) @ np.abs(wc).T + np.abs(bq)
    return exact, s_abs, sx * sw, wc.shape[1]


def test_refuse_names_the_option(digits):
    # "refuse" was lower's default until qb.quantize's default recipe kept the logits float
    _, path, _ = digits
    with pytest.raises(qb.LoweringError, match="Gemm.*not quantized.*float_outputs='dequantize'"):
        qb.lower(path, float_outputs="refuse")


def test_digits_logits_agree_with_float64_and_onnx_runtime(digits):
    _, path, x = digits
    model = onnx.load(path)
    prog = qb.lower(model, float_outputs="dequantize")
    (out,) = prog.outputs
    assert out.tensor.dtype == np.int32 and out.scale.dtype == np.float32 and out.axis == -1
    feeds = {"x": x.numpy()}
    got = prog.run(feeds)[out.name]
    assert got.dtype == np.float32 and got.shape == (16, 10)
    exact, s_abs, acc_scale, k = _last_gemm_float64(model, prog, feeds)
    np.testing.assert_allclose(out.scale, acc_scale.astype(np.float32), rtol=0, atol=0)
    err64 = np.abs(got - exact) / acc_scale  # in accumulator units
    assert np.all(err64 <= 2 * U * s_abs), float(np.max(err64 / (2 * U * s_abs)))
    (ort_out,) = _ort_node_by_node(model, prog, feeds)
    err_ort = np.abs(got.astype(np.float64) - ort_out) / acc_scale
    tol = (_gamma(k + 3) + 2 * U) * s_abs
    print(f"\nK={k}: vs float64 max {err64.max():.4f} acc units (tol {2 * U * s_abs.max():.4f});"
          f" vs ORT node by node max {err_ort.max():.4f}, mean {err_ort.mean():.5f} acc units"
          f" (tol {tol.min():.3f}..{tol.max():.3f})")  # fmt: skip
    assert np.all(err_ort <= tol), float(np.max(err_ort / tol))


def test_three_emitters_bit_exact_on_the_accumulator(digits, tmp_path, run_c):
    import onnxruntime as ort

    _, path, x = digits
    prog = qb.lower(path, float_outputs="dequantize")
    feeds = {"x": x.numpy()}
    reference = prog.run(feeds, integer=True)
    (name,) = reference
    assert reference[name].dtype == np.int32
    assert np.abs(reference[name]).max() > 127  # the codes are the accumulator, not 8-bit
    from_c = run_c(prog, feeds, tmp_path / "c", opt="-O1")
    header = (tmp_path / "c" / "qb_model.h").read_text()
    assert "#define QB_OUT0_SCALES {" in header and "#define QB_OUT0_AXIS -1" in header
    prog.save_onnx(tmp_path / "int.onnx", {"x": tuple(x.shape)})
    sess = ort.InferenceSession(str(tmp_path / "int.onnx"), providers=["CPUExecutionProvider"])
    codes = prog.run_integer(feeds)
    (from_onnx,) = sess.run(None, {b.tensor.name: codes[b.tensor.name] for b in prog.inputs})
    np.testing.assert_array_equal(from_c[name], reference[name])
    np.testing.assert_array_equal(from_onnx, reference[name])
    # the float outputs are those codes times the recorded scale, outside the program
    (b,) = prog.outputs
    want = (reference[name].astype(np.float64) * b.scale.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(prog.run(feeds)[name], want)


def test_npz_keeps_the_accumulator_scale(digits, tmp_path):
    _, path, x = digits
    prog = qb.lower(path, float_outputs="dequantize")
    save_npz(prog, tmp_path / "p.npz")
    again = load_npz(tmp_path / "p.npz")
    (b,) = again.outputs
    np.testing.assert_array_equal(b.scale, prog.outputs[0].scale)
    assert b.axis == prog.outputs[0].axis
    feeds = {"x": x.numpy()}
    np.testing.assert_array_equal(again.run(feeds)[b.name], prog.run(feeds)[b.name])


def test_integer_mode_is_bit_identical_with_lower_run(digits):
    qmodel, path, x = digits
    expected = qb.lower(path, float_outputs="dequantize").run({"x": x.numpy()})
    with qb.integer_mode(qmodel, float_outputs="dequantize") as m, torch.no_grad():
        got = m(x)
    (want,) = expected.values()
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), want)
    with pytest.raises(qb.LoweringError, match="float_outputs='dequantize'"):
        with qb.integer_mode(qmodel, float_outputs="refuse") as m, torch.no_grad():
            m(x)
    with qb.integer_mode(qmodel) as m, torch.no_grad():  # the default: "dequantize"
        np.testing.assert_array_equal(m(x).numpy(), want)


def _per_channel_conv(qdq_graph, tail: str):
    """QDQ Conv (per-channel weights, int32 bias on s_x * s_w[c]) with a float output."""
    g = qdq_graph((2, 3, 6, 6), scale=0.05, zero=7)
    rng = np.random.default_rng(3)
    wq = rng.integers(-63, 64, size=(5, 3, 3, 3)).astype(np.int8)
    sw = (0.02 * rng.uniform(0.5, 1.5, 5)).astype(np.float32)
    sb = (np.float32(0.05) * sw).astype(np.float32)
    bq = rng.integers(-2000, 2000, size=5).astype(np.int32)
    w = g.node("DequantizeLinear", [g.const(wq), g.const(sw), g.const(np.zeros(5, np.int8))],
               axis=0)  # fmt: skip
    b = g.node("DequantizeLinear", [g.const(bq), g.const(sb), g.const(np.zeros(5, np.int32))],
               axis=0)  # fmt: skip
    y = g.node("Conv", [g.x, w, b], pads=[1, 1, 1, 1])
    if tail == "relu":
        y = g.node("Relu", [y])
    elif tail == "clip":
        y = g.node("Clip", [y, g.const(np.float32(0)), g.const(np.float32(6))])
    elif tail == "flatten":
        y = g.node("Flatten", [y])
    elif tail == "transpose":
        y = g.node("Transpose", [y], perm=[0, 2, 3, 1])
    elif tail == "slice":  # channels 1..3
        y = g.node("Slice", [y, *(g.const(np.array([v], np.int64)) for v in (1, 4, 1))])
    return g.model(y), y, (np.float64(0.05) * sw, 3 * 9)


def test_per_channel_conv_with_relu(qdq_graph, tmp_path, run_c):
    model, name, (acc_scale, k) = _per_channel_conv(qdq_graph, "relu")
    prog = qb.lower(model, float_outputs="dequantize")
    (b,) = prog.outputs
    assert b.axis == 1 and b.scale.shape == (5,)
    x = np.random.default_rng(4).normal(0, 3, (2, 3, 6, 6)).astype(np.float32)
    codes = prog.run({"x": x}, integer=True)[name]
    assert codes.dtype == np.int32 and codes.min() == 0  # the Relu clamps the codes at 0
    got = prog.run({"x": x})[name]
    (want,) = _ort(model).run(None, {"x": x})
    # S <= K * max|q_x - z_x| * max|q_w| + max|q_b| (codes), tolerance as the module docstring
    s_max = k * 255 * 63 + 2000
    err = np.abs(got.astype(np.float64) - want) / acc_scale.reshape(1, -1, 1, 1)
    assert err.max() <= (_gamma(k + 3) + 2 * U) * s_max
    from_c = run_c(prog, {"x": x}, tmp_path / "c")
    np.testing.assert_array_equal(from_c[name], codes)


def test_per_channel_conv_flattened(qdq_graph):
    """Flatten of a per-channel Conv output: the channel index still varies along one axis (36
    positions per channel), so the scale moves with it, one value per flattened position."""
    model, name, (acc_scale, k) = _per_channel_conv(qdq_graph, "flatten")
    prog = qb.lower(model, float_outputs="dequantize")
    (b,) = prog.outputs
    assert b.axis == 1 and b.scale.shape == (5 * 36,)
    np.testing.assert_array_equal(b.scale, np.repeat(acc_scale.astype(np.float32), 36))
    x = np.random.default_rng(9).normal(0, 3, (2, 3, 6, 6)).astype(np.float32)
    got = prog.run({"x": x})[name]
    (want,) = _ort(model).run(None, {"x": x})
    s_max = k * 255 * 63 + 2000
    err = np.abs(got.astype(np.float64) - want) / np.repeat(acc_scale, 36).reshape(1, -1)
    assert err.max() <= (_gamma(k + 3) + 2 * U) * s_max


@pytest.mark.parametrize(
    ("tail", "axis", "channels"), [("transpose", 3, [0, 1, 2, 3, 4]), ("slice", 1, [1, 2, 3])]
)
def test_per_channel_scales_follow_the_channels(qdq_graph, tail, axis, channels):
    model, name, (acc_scale, k) = _per_channel_conv(qdq_graph, tail)
    prog = qb.lower(model, float_outputs="dequantize")
    (b,) = prog.outputs
    assert b.axis == axis
    np.testing.assert_array_equal(b.scale, acc_scale[channels].astype(np.float32))
    x = np.random.default_rng(10).normal(0, 3, (2, 3, 6, 6)).astype(np.float32)
    got = prog.run({"x": x})[name]
    (want,) = _ort(model).run(None, {"x": x})
    shape = [-1 if i == axis else 1 for i in range(4)]
    err = np.abs(got.astype(np.float64) - want) / acc_scale[channels].reshape(shape)
    assert err.max() <= (_gamma(k + 3) + 2 * U) * (k * 255 * 63 + 2000)


def test_per_channel_clip_after_the_layer_stays_refused(qdq_graph):
    model, _, _ = _per_channel_conv(qdq_graph, "clip")
    with pytest.raises(qb.LoweringError, match="not quantized") as e:
        qb.lower(model, float_outputs="dequantize")
    assert "float_outputs='dequantize'" not in str(e.value)  # the option was given: no advice


def test_channels_split_over_two_axes_stay_refused(qdq_graph):
    """``Linear(8, 10)`` output reshaped to (N, 2, 5) with per-channel weight scales: the
    channel varies along two axes, which one per-channel scale axis cannot describe."""
    g = qdq_graph((3, 8), scale=0.05, zero=3)
    out = g.node("MatMul", [g.x, g.weight((8, 10), axis=1)])
    y = g.node("Reshape", [out, g.const(np.array([-1, 2, 5], np.int64))])
    with pytest.raises(qb.LoweringError, match="Reshape.*not quantized"):
        qb.lower(g.model(y), float_outputs="dequantize")


def test_matmul_with_a_bias_add(qdq_graph):
    """torch's 3-D Linear: MatMul -> Add(DequantizeLinear(int32 bias)), per-tensor weights."""
    g = qdq_graph((2, 4, 8), scale=0.05, zero=3)
    rng = np.random.default_rng(5)
    wq = rng.integers(-63, 64, size=(8, 6)).astype(np.int8)
    sw = np.float32(0.03)
    bq = rng.integers(-500, 500, size=6).astype(np.int32)
    w = g.node("DequantizeLinear", [g.const(wq), g.const(sw), g.const(np.int8(0))])
    b = g.node("DequantizeLinear", [g.const(bq), g.const(np.float32(np.float32(0.05) * sw)),
                                    g.const(np.int32(0))])  # fmt: skip
    y = g.node("Add", [g.node("MatMul", [g.x, w]), b])
    model = g.model(y)
    prog = qb.lower(model, float_outputs="dequantize")
    (out,) = prog.outputs
    assert out.scale.shape == (1,) and out.tensor.scale == float(out.scale[0])
    x = np.random.default_rng(6).normal(0, 3, (2, 4, 8)).astype(np.float32)
    got = prog.run({"x": x})[y]
    (want,) = _ort(model).run(None, {"x": x})
    s_max = 8 * 255 * 63 + 500
    err = np.abs(got.astype(np.float64) - want) / (0.05 * float(sw))
    assert err.max() <= (_gamma(8 + 3) + 2 * U) * s_max


def test_per_tensor_linear_reshaped(qdq_graph, tmp_path, run_c):
    """A Linear's float output reshaped (one weight scale: the accumulator moves with it); the
    three emitters agree on the moved int32 codes."""
    import onnxruntime as ort

    g = qdq_graph((3, 8), scale=0.05, zero=3)
    rng = np.random.default_rng(7)
    wq = rng.integers(-63, 64, size=(6, 8)).astype(np.int8)
    sw = np.float32(0.03)
    bq = rng.integers(-500, 500, size=6).astype(np.int32)
    w = g.node("DequantizeLinear", [g.const(wq), g.const(sw), g.const(np.int8(0))])
    b = g.node("DequantizeLinear", [g.const(bq), g.const(np.float32(np.float32(0.05) * sw)),
                                    g.const(np.int32(0))])  # fmt: skip
    gemm = g.node("Gemm", [g.x, w, b], transB=1)
    y = g.node("Reshape", [gemm, g.const(np.array([3, 2, 3], np.int64))])
    model = g.model(y)
    prog = qb.lower(model, float_outputs="dequantize")
    x = np.random.default_rng(8).normal(0, 3, (3, 8)).astype(np.float32)
    got = prog.run({"x": x})[y]
    (want,) = _ort(model).run(None, {"x": x})
    assert got.shape == want.shape == (3, 2, 3)
    s_max = 8 * 255 * 63 + 500
    err = np.abs(got.astype(np.float64) - want) / (0.05 * float(sw))
    assert err.max() <= (_gamma(8 + 3) + 2 * U) * s_max
    codes = prog.run({"x": x}, integer=True)[y]
    np.testing.assert_array_equal(run_c(prog, {"x": x}, tmp_path / "c")[y], codes)
    prog.save_onnx(tmp_path / "int.onnx", {"x": x.shape})
    sess = ort.InferenceSession(str(tmp_path / "int.onnx"), providers=["CPUExecutionProvider"])
    feeds = prog.run_integer({"x": x})
    (from_onnx,) = sess.run(None, {b.tensor.name: feeds[b.tensor.name] for b in prog.inputs})
    np.testing.assert_array_equal(from_onnx, codes)


@pytest.mark.parametrize("op", ["GlobalAveragePool", "ReduceMean"])
def test_pooled_float_output(qdq_graph, op):
    """A backbone's pooled features as a float graph output (HF RegNet's ``pooler_output``, a
    mean after the last QuantizeLinear; 2026-12-02: "graph output 'mean_2' ... is not
    quantized", with the default and the int8 recipe alike). The mean stays within its input's
    real range ``s max|q - z|`` = 0.05 x 252 = 12.6, so it is realized on an int16 grid of step
    12.6 / 32767 = 3.8e-4 and dequantized outside the program: within one such step of ORT's
    float mean (half a step of rounding, plus the fixed-point 1 / N)."""
    g = qdq_graph((2, 4, 5, 5), scale=0.05, zero=3)
    axes = [g.const(np.array([2, 3], np.int64))] if op == "ReduceMean" else []
    model = g.model(g.node(op, [g.x, *axes]))
    x = np.random.default_rng(0).normal(2, 3, (2, 4, 5, 5)).astype(np.float32)
    prog = qb.lower(model)
    (got,) = prog.run({"x": x}).values()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (ref,) = sess.run(None, {"x": x})
    step = 0.05 * 252 / 32767
    assert got.shape == ref.shape == (2, 4, 1, 1)
    assert np.abs(got.astype(np.float64) - ref).max() <= step


@pytest.mark.parametrize("op", ["GlobalAveragePool", "ReduceMean"])
def test_pooled_silu_float_output(qdq_graph, op):
    """MobileViT's / EfficientNet's pooled features: the mean of a SiLU of codes with no
    QuantizeLinear between, a float graph output (HF MobileViT, 2026-12-02: "ReduceMean: its
    input is an unquantized float function"). The SiLU is a table to int16 codes of max |silu|
    / 32767 (0.05 x 252 = 12.6 here: 3.8e-4 per code, half of it per element), then the mean on
    an int16 grid of its bound (the same 12.6): within two such steps of ORT's float mean."""
    g = qdq_graph((2, 4, 5, 5), scale=0.05, zero=3)
    silu = g.node("Mul", [g.x, g.node("Sigmoid", [g.x])])
    axes = [g.const(np.array([2, 3], np.int64))] if op == "ReduceMean" else []
    model = g.model(g.node(op, [silu, *axes]))
    x = np.random.default_rng(0).normal(2, 3, (2, 4, 5, 5)).astype(np.float32)
    prog = qb.lower(model)
    assert {"lut", "reduce_mean"} <= set(prog.op_counts())
    (got,) = prog.run({"x": x}).values()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (ref,) = sess.run(None, {"x": x})
    step = 0.05 * 252 / 32767
    assert got.shape == ref.shape == (2, 4, 1, 1)
    assert np.abs(got.astype(np.float64) - ref).max() <= 2 * step


def test_residual_sum_float_output(qdq_graph):
    """A float graph output that is a residual sum ``x + f(x)`` with no QuantizeLinear after it
    (HF SigLIP's pooler: the attention-pooling head ends with ``residual + mlp(x)``, then a
    Gather; 2026-12-02: "graph output ... is not quantized"). The sum is bounded by its
    operands' ranges, (0.05 + 0.07) x 128 = 15.4, so it is realized on an int16 grid of step
    15.4 / 32767 = 4.7e-4 and dequantized outside the program: within one step of ORT's float
    sum (half a step of rounding, plus the fixed-point rescale). The Relu's grid 0.07 makes no
    requantization tie from the 0.05 grid (10k = 14m + 7 has no solution), where the program
    and ORT may round a code apart (with 0.08: one element 1 LSB off, 0.08)."""
    g = qdq_graph((2, 4, 8), scale=0.05, zero=128)
    residual = g.quant(g.node("Relu", [g.x]), 0.07, 128)
    total = g.node("Add", [g.x, residual])
    model = g.model(g.node("Gather", [total, g.const(np.int64(0))], axis=1))
    x = np.random.default_rng(0).normal(0, 2, (2, 4, 8)).astype(np.float32)
    prog = qb.lower(model)
    (got,) = prog.run({"x": x}).values()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (ref,) = sess.run(None, {"x": x})
    assert got.shape == ref.shape == (2, 8)
    assert np.abs(got.astype(np.float64) - ref).max() <= (0.05 + 0.07) * 128 / 32767


def test_per_channel_accumulator_split_into_float_outputs():
    """``MatMul(per-channel weights) -> Split`` into two float graph outputs (ModelOpt's int8
    GPT-2 splits the fused q, k, v projection): each part keeps its channels' scales. The lowering
    of Split crashed with IndexError (its Slice parts had no input to look the shape up by).
    Tolerance: the same float rounding bound as above, ``(gamma(K + 3) + 2 u) * S``, with
    ``S <= K * 255 * 127`` codes; here 1e-4 of the largest output covers it (K = 6)."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    k, n = 6, 8
    w_scale = rng.uniform(0.01, 0.05, n).astype(np.float32)
    inits = [
        numpy_helper.from_array(rng.integers(-127, 128, (k, n)).astype(np.int8), "wq"),
        numpy_helper.from_array(w_scale, "ws"),
        numpy_helper.from_array(np.zeros(n, np.int8), "wz"),
        numpy_helper.from_array(np.float32(0.02), "xs"),
        numpy_helper.from_array(np.int8(0), "xz"),
        numpy_helper.from_array(np.array([3, 5], np.int64), "parts"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xf"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=1),
        helper.make_node("MatMul", ["xf", "w"], ["h"]),
        helper.make_node("Split", ["h", "parts"], ["y1", "y2"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "split", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, k])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y1", "y2")], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    prog = qb.lower(model, float_outputs="dequantize")
    got = prog.run({"x": x})
    ref = _ort(model).run(None, {"x": x})
    for name, want in zip(("y1", "y2"), ref, strict=True):
        assert np.abs(got[name] - want).max() <= 1e-4 * np.abs(want).max()
