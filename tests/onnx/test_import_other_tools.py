"""``import_onnx`` of quantized files in the forms other tools write, each built here with
``onnx.helper`` to the tool's exact node pattern (no tool needed to run the tests).

* QLinearSoftmax (com.microsoft) whose ``opset`` attribute differs from the model's: ONNX
  Runtime's quantizer writes the float model's opset there (and copies ``axis`` only when the
  Softmax has one); below 13 the kernel flattens the input to 2-D at ``axis``. A missing axis is
  -1 at every opset (the contrib schema's default; measured on ORT 1.32, which so runs an opset-12
  model's quantized Softmax over the last axis, unlike its float model).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb

ort = pytest.importorskip("onnxruntime")


def _softmax_file(path, softmax_opset: int, model_opset: int = 17, **attrs) -> str:
    """x -> QuantizeLinear(u8) -> QLinearSoftmax(opset=softmax_opset) -> DequantizeLinear -> y."""
    inits = [numpy_helper.from_array(np.array(v, dtype), n) for n, v, dtype in
             [("xs", 0.05, np.float32), ("xz", 128, np.uint8),
              ("ys", 1 / 256, np.float32), ("yz", 0, np.uint8)]]  # fmt: skip
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q"),
        helper.make_node("QLinearSoftmax", ["xq", "xs", "xz", "ys", "yz"], ["yq"], name="sm",
                         domain="com.microsoft", opset=softmax_opset, **attrs),
        helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"], name="dq"),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "softmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])], inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", model_opset), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.save(model, path)
    return str(path)


@pytest.mark.parametrize(
    "softmax_opset, model_opset, attrs",
    [(12, 17, {}), (12, 17, {"axis": 2}), (12, 17, {"axis": 0}), (12, 17, {"axis": 1}),
     (13, 17, {}), (13, 17, {"axis": 1}), (11, 11, {}), (11, 11, {"axis": 1}), (13, 12, {})],
)  # fmt: skip
def test_qlinear_softmax_keeps_its_own_opset_semantics(tmp_path, softmax_opset, model_opset, attrs):
    """Torch on the imported model, and the lowered program, against ORT's QLinearSoftmax kernel
    in output steps (1/256). Measured: at most 1 step (ORT's kernel is a float exp table times
    floor(1 / y_scale), the _unfold docstring); the wrong semantics are off by tens of steps (a
    softmax over 12 or 6 values against one over 4). Before the fix: (12, 17, axis 0 or 1)
    imported as one-axis softmaxes, (11, 11, no axis) as a flatten at axis 1, and (12, 17) /
    (13, 12) with no axis (ORT's own quantizer output for an opset-12 model) were refused."""
    path = _softmax_file(tmp_path / "sm.onnx", softmax_opset, model_opset, **attrs)
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32) * 2
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ours = qb.import_onnx(path)(torch.from_numpy(x)).detach().numpy()
    assert np.abs(ours - ref).max() * 256 <= 1.0 + 1e-6
    if "axis" in attrs:
        return  # lower refuses these, naming the node (a last-axis softmax of its own opset only)
    (lowered,) = qb.lower(onnx.load(path)).run({"x": x}).values()
    assert np.abs(lowered - ref).max() * 256 <= 1.0 + 1e-6


def test_opset13_softmax_in_an_opset12_model_is_refused_with_the_fix(tmp_path):
    path = _softmax_file(tmp_path / "sm.onnx", 13, model_opset=12, axis=1)
    with pytest.raises(ValueError, match=r"'sm'.*opset-13 Softmax semantics.*re-export"):
        qb.import_onnx(path)


# ---- Brevitas: QCDQ (Q -> Clip -> DQ) and QONNX (Quant op) ---------------------------------------
# Brevitas 0.13.4 on torch 2.13 (export_onnx_qcdq / export_qonnx of QuantIdentity -> QuantLinear ->
# QuantReLU -> QuantLinear at 4 bits) writes exactly these patterns: activations
# QuantizeLinear -> Clip(int8 -8, 7 | uint8 0, 15) -> DequantizeLinear, weights int8 codes ->
# Clip(-7, 7) -> DequantizeLinear (narrow range), float biases; TorchScript export lists the
# biases, the dynamo export every constant, as graph inputs too. QONNX writes one
# Quant(x, scale, zero_point, bit_width; signed, narrow, rounding_mode) per quantizer.
_RNG = np.random.default_rng(3)
_W1 = _RNG.integers(-9, 10, (8, 6)).astype(np.int8)  # codes outside [-7, 7]: the Clip matters
_W2 = _RNG.integers(-7, 8, (3, 8)).astype(np.int8)
_B1, _B2 = (_RNG.standard_normal(n).astype(np.float32) * 0.1 for n in (8, 3))
_SX, _SW1, _SH, _SW2 = 0.3, 0.04, 0.1, 0.03


def _const(name, value, dtype):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _brevitas_file(path, form: str, inputs_too: bool = False) -> str:
    """The 4-bit MLP in Brevitas's ``qcdq`` or ``qonnx`` form (``qonnx_rounding`` for a refusal)."""
    n, inits = [], [_const("b1", _B1, np.float32), _const("b2", _B2, np.float32)]
    if form == "qcdq":
        inits += [_const(k, v, t) for k, v, t in [
            ("sx", _SX, np.float32), ("z8", 0, np.int8), ("m8", -8, np.int8), ("p7", 7, np.int8),
            ("m7", -7, np.int8), ("w1", _W1, np.int8), ("sw1", _SW1, np.float32),
            ("w2", _W2, np.int8), ("sw2", _SW2, np.float32), ("sh", _SH, np.float32),
            ("zu", 0, np.uint8), ("p15", 15, np.uint8)]]  # fmt: skip
        n += [helper.make_node("QuantizeLinear", ["x", "sx", "z8"], ["xq"]),
              helper.make_node("Clip", ["xq", "m8", "p7"], ["xc"]),
              helper.make_node("DequantizeLinear", ["xc", "sx", "z8"], ["xd"]),
              helper.make_node("Clip", ["w1", "m7", "p7"], ["w1c"], name="w1_clip"),
              helper.make_node("DequantizeLinear", ["w1c", "sw1", "z8"], ["w1d"]),
              helper.make_node("Gemm", ["xd", "w1d", "b1"], ["h"], transB=1),
              helper.make_node("Relu", ["h"], ["r"]),
              helper.make_node("QuantizeLinear", ["r", "sh", "zu"], ["rq"]),
              helper.make_node("Clip", ["rq", "zu", "p15"], ["rc"]),
              helper.make_node("DequantizeLinear", ["rc", "sh", "zu"], ["rd"]),
              helper.make_node("Clip", ["w2", "m7", "p7"], ["w2c"]),
              helper.make_node("DequantizeLinear", ["w2c", "sw2", "z8"], ["w2d"]),
              helper.make_node("Gemm", ["rd", "w2d", "b2"], ["y"], transB=1)]  # fmt: skip
        opsets = [helper.make_opsetid("", 17)]
    else:
        mode = "FLOOR" if form == "qonnx_rounding" else "ROUND"
        inits += [_const(k, v, np.float32) for k, v, _ in [
            ("sx", _SX, 0), ("z", 0, 0), ("b4", 4, 0), ("b32", 32, 0), ("sw1", _SW1, 0),
            ("sw2", _SW2, 0), ("sh", _SH, 0), ("w1", _W1 * _SW1, 0), ("w2", _W2 * _SW2, 0),
            ("sb", 1e-4, 0)]]  # fmt: skip

        def quant(x, s, bits, y, signed=1, narrow=0, name=""):
            return helper.make_node("Quant", [x, s, "z", bits], [y], name=name or y,
                                    domain="qonnx.custom_op.general", signed=signed,
                                    narrow=narrow, rounding_mode=mode)  # fmt: skip

        n += [quant("x", "sx", "b4", "xd"), quant("w1", "sw1", "b4", "w1d", narrow=1),
              quant("b1", "sb", "b32", "b1d"),
              helper.make_node("Gemm", ["xd", "w1d", "b1d"], ["h"], transB=1),
              helper.make_node("Relu", ["h"], ["r"]), quant("r", "sh", "b4", "rd", signed=0),
              quant("w2", "sw2", "b4", "w2d", narrow=1),
              helper.make_node("Gemm", ["rd", "w2d", "b2"], ["y"], transB=1)]  # fmt: skip
        opsets = [helper.make_opsetid("", 20), helper.make_opsetid("qonnx.custom_op.general", 2)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 6])]
    if inputs_too:
        inputs += [helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in inits]
    graph = helper.make_graph(
        n, "brevitas", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 3])],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 9
    onnx.save(model, path)
    return str(path)


def _ort(path, x, optimize=False):
    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]


_X = np.random.default_rng(4).standard_normal((16, 6)).astype(np.float32)


@pytest.mark.parametrize("form", ["qcdq", "qonnx"])
def test_brevitas_4bit_mlp_imports_trains_on_its_grid_and_lowers(tmp_path, form):
    """Reference: ONNX Runtime (graph optimisations off) on the QCDQ file, which is what Brevitas
    writes for the same quantizers (for ``qonnx`` an independent hand-built file). Torch computes
    the same float ops on the same codes: measured 6e-8 (float32 summation order), asserted 1e-5
    (200x that, far below one output step of ~1e-3 of a code flip). Before the fix: Case 4b
    (integer weight codes -> Clip) failed import and lower ("read as integers but no
    QuantizeLinear produces it"); QONNX was refused as unknown op / "a float model"."""
    ref = _ort(_brevitas_file(tmp_path / "ref.onnx", "qcdq"), _X)
    path = _brevitas_file(tmp_path / "m.onnx", form)
    model = qb.import_onnx(path)
    assert np.abs(model(torch.from_numpy(_X)).detach().numpy() - ref).max() < 1e-5
    # lower: integer-only, so float biases become int32 on the grid input scale x weight scale.
    # ONNX Runtime's integer engine (optimisations on) does so for the hidden layer (QGemm) and
    # runs the last Gemm in float: lower differs from it by at most half a bias step of the last
    # layer, 0.5 x 0.1 x 0.03 (measured 7.3e-4). (Against the float reference one hidden code
    # flips on this input, 0.012: the file's float bias is not on the integer grid.)
    (lowered,) = qb.lower(path).run({"x": _X}).values()
    engine = _ort(tmp_path / "ref.onnx", _X, optimize=True)
    assert np.abs(lowered - engine).max() <= 0.5 * _SH * _SW2 + 1e-6
    # one large SGD step, then export: the weight codes stay on the file's narrow 4-bit grid
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    model.train()
    model(torch.from_numpy(_X)).pow(2).mean().backward()
    torch.optim.SGD(params, lr=5.0).step()
    model.eval()
    assert all(not torch.equal(a, p.detach()) for a, p in zip(before, params, strict=True))
    exported = qb.export(model, tmp_path / "re.onnx", (torch.from_numpy(_X),))
    codes = [numpy_helper.to_array(i) for i in exported.graph.initializer]
    weights = [c for c in codes if c.dtype == np.int8 and c.ndim == 2]
    assert len(weights) == 2 and all(np.abs(w).max() <= 7 for w in weights)
    got = _ort(tmp_path / "re.onnx", _X)
    assert np.abs(model(torch.from_numpy(_X)).detach().numpy() - got).max() < 1e-5


@pytest.mark.parametrize("inputs_too", [False, True])
def test_brevitas_qcdq_folds_its_clipped_weights(tmp_path, inputs_too):
    """Fold Case 3c: ``int8 codes -> Clip`` is the clipped constant, so ``DQ -> Gemm`` can fold;
    and constants the fold drops are dropped from the graph inputs too (Brevitas's dynamo export
    lists them all as inputs: ONNX Runtime refused the folded file, "Required inputs ... are
    missing"). The folded file runs in ONNX Runtime to the unfolded file's output: measured 0
    difference (same engine, same integer kernels)."""
    path = _brevitas_file(tmp_path / "m.onnx", "qcdq", inputs_too)
    folded = qb.fold(path, tmp_path / "f.onnx")
    inits = {i.name for i in folded.graph.initializer}
    assert not [n.name for n in folded.graph.node if n.op_type == "Clip" and n.input[0] in inits]
    assert {i.name for i in folded.graph.input} <= inits | {"x"}
    expected = _ort(path, _X, optimize=True)
    assert np.abs(_ort(tmp_path / "f.onnx", _X, optimize=True) - expected).max() < 1e-6


def test_qonnx_forms_without_a_qdq_form_are_refused_naming_the_node(tmp_path):
    path = _brevitas_file(tmp_path / "m.onnx", "qonnx_rounding")
    for call in (qb.import_onnx, qb.lower, qb.fold):
        with pytest.raises(
            ValueError, match=r"QONNX node 'xd' \(op Quant\): rounding_mode FLOOR.*export_onnx_qcdq"
        ):
            call(path)


def test_ort_nhwc_qlinear_conv_is_refused_naming_the_node(tmp_path):
    """ORT_ENABLE_ALL saves convolutions as com.microsoft QLinearConv(channels_last=1) between
    Transposes (NHWC). Before: import failed in capture ("expected input[N, 8, 8, 3] to have 3
    channels") and lower with a numpy matmul shape error."""
    inits = [_const(k, v, t) for k, v, t in [
        ("s", 0.05, np.float32), ("z", 128, np.uint8), ("w", np.ones((4, 3, 3, 3)), np.int8),
        ("ws", 0.01, np.float32), ("wz", 0, np.int8)]]  # fmt: skip
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
        helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 3, 1]),
        helper.make_node("QLinearConv", ["qt", "s", "z", "w", "ws", "wz", "s", "z"], ["c"],
                         name="conv_nhwc", domain="com.microsoft", channels_last=1,
                         kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["c"], ["ct"], perm=[0, 3, 1, 2]),
        helper.make_node("DequantizeLinear", ["ct", "s", "z"], ["y"]),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "nhwc", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])], inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    for call in (qb.import_onnx, qb.lower):
        with pytest.raises(ValueError, match=r"conv_nhwc.*channels_last=1 is ONNX Runtime's NHWC"):
            call(str(tmp_path / "m.onnx"))


def _qdq_gemm_file(path, inits, domain: str, gemm_inputs, y_zero: str, weight_attrs) -> None:
    """x -> Q(s, z) -> DQ -> Gemm(transB=1) with DQ(w, ws, wz) -> Q(ys, y_zero) -> DQ -> y, [16, 6]
    -> [16, 8], the Q/DQ nodes in ``domain`` (ORT's ``UseQDQContribOps`` writes com.microsoft),
    opset 21."""

    def qdq(op, ins, out, **attrs):
        return helper.make_node(op, ins, [out], domain=domain, **attrs)

    nodes = [qdq("QuantizeLinear", ["x", "s", "z"], "q"), qdq("DequantizeLinear", ["q", "s", "z"], "d"),
             qdq("DequantizeLinear", ["w", "ws", "wz"], "wd", **weight_attrs),
             helper.make_node("Gemm", gemm_inputs, ["g"], transB=1),
             qdq("QuantizeLinear", ["g", "ys", y_zero], "gq"),
             qdq("DequantizeLinear", ["gq", "ys", y_zero], "y")]  # fmt: skip
    graph = helper.make_graph(
        nodes, "qdq_gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 8])], inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    onnx.save(model, path)


@pytest.mark.parametrize("domain", ["", "com.microsoft"])
def test_int16_activations_stay_in_qdq_form_when_folded(tmp_path, domain):
    """ORT's A16W8 QDQ (``UseQDQContribOps`` writes it in the com.microsoft domain): the fold
    made a QGemm reading int16 codes, which ONNX Runtime refuses ("Type 'tensor(int16)' of input
    parameter ... of operator (QGemm)"). Now the Gemm stays DQ -> Gemm -> Q and ORT runs the
    folded file to the original's output (measured: identical)."""
    inits = [_const(k, v, t) for k, v, t in [
        ("s", 1e-3, np.float32), ("z", 0, np.int16), ("w", _W1, np.int8), ("ws", 0.02, np.float32),
        ("wz", 0, np.int8), ("b", _B1, np.float32), ("ys", 2e-3, np.float32)]]  # fmt: skip

    _qdq_gemm_file(tmp_path / "m.onnx", inits, domain, ["d", "wd", "b"], "z", {})
    qb.fold(tmp_path / "m.onnx", tmp_path / "f.onnx")
    expected = _ort(tmp_path / "m.onnx", _X)
    assert np.abs(_ort(tmp_path / "f.onnx", _X, optimize=True) - expected).max() < 1e-6


@pytest.mark.parametrize("domain", ["", "com.microsoft"])
def test_int4_weights_lower(tmp_path, domain):
    """ORT's A8W4 QDQ (``UseQDQContribOps`` int4 weights: com.microsoft DequantizeLinear, INT4
    codes and per-channel INT4 zero points). Before: lower refused it, "zero point type int4 is
    not an integer". Reference: ONNX Runtime, optimisations off (float Gemm on the dequantized
    values, then QuantizeLinear); the integer program computes the same accumulator exactly and
    may differ only where the requantization sits on a rounding tie: at most 1 output step
    (measured 0)."""
    w = _RNG.integers(-8, 8, (8, 6))

    def init(name, value, dtype):
        return helper.make_tensor(name, dtype, np.shape(value), np.ravel(value).tolist())

    inits = [init(k, v, t) for k, v, t in [
        ("s", 0.05, TensorProto.FLOAT), ("z", 128, TensorProto.UINT8), ("w", w, TensorProto.INT4),
        ("ws", np.linspace(0.01, 0.03, 8), TensorProto.FLOAT), ("wz", [0] * 8, TensorProto.INT4),
        ("ys", 0.1, TensorProto.FLOAT), ("yz", 120, TensorProto.UINT8)]]  # fmt: skip

    _qdq_gemm_file(tmp_path / "m.onnx", inits, domain, ["d", "wd"], "yz", {"axis": 0})
    (lowered,) = qb.lower(str(tmp_path / "m.onnx")).run({"x": _X}).values()
    assert np.abs(lowered - _ort(tmp_path / "m.onnx", _X)).max() <= 0.1 + 1e-6


@pytest.mark.parametrize("form", ["qonnx", "qonnx_rounding"])
def test_inspect_reads_qonnx_quant_as_quantization(tmp_path, form):
    """``quantbridge inspect`` listed QONNX ``Quant`` nodes as float ops. Now a QONNX file reports
    what its QCDQ twin (Brevitas's other export of the same quantizers) reports; a form the
    rewrite refuses (FLOOR rounding) counts its Quant nodes as neither int8 nor float."""
    from quantbridge.onnx import inspect_model

    qcdq = inspect_model(_brevitas_file(tmp_path / "qcdq.onnx", "qcdq"))
    report = inspect_model(_brevitas_file(tmp_path / "m.onnx", form))
    assert "Quant" not in report.float_ops and "Quant" not in report.int8_ops
    assert report.op_counts["Quant"] == 5  # the file's own ops are listed
    if form == "qonnx":
        assert (report.int8_ops, report.float_ops) == (qcdq.int8_ops, qcdq.float_ops)
        assert report.activation_quantizers == qcdq.activation_quantizers
        assert report.form == qcdq.form == "QDQ"


@pytest.mark.parametrize("op", ["DynamicQuantizeMatMul", "MatMulIntegerToFloat"])
def test_fused_dynamic_quantization_is_named_not_called_float(tmp_path, op):
    """ORT's quantize_dynamic saved after its graph optimisations: the only quantized ops are
    com.microsoft DynamicQuantizeMatMul (or MatMulIntegerToFloat, here on a uint8 graph input),
    which quantize their input with run-time scales. Before: fold and lower called the file "a
    float model", compare found "no quantized tensor"."""
    w = _const("w", _W1.T, np.int8)
    inits = [w, _const("ws", 0.02, np.float32), _const("wz", 0, np.int8)]
    if op == "DynamicQuantizeMatMul":
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 6])
        node = helper.make_node(
            op, ["x", "w", "ws", "wz"], ["y"], name="mm", domain="com.microsoft"
        )
    else:
        x = helper.make_tensor_value_info("x", TensorProto.UINT8, [16, 6])
        inits += [_const("xs", 0.05, np.float32), _const("xz", 128, np.uint8)]
        node = helper.make_node(op, ["x", "w", "xs", "ws", "xz", "wz"], ["y"], name="mm",
                                domain="com.microsoft")  # fmt: skip
    graph = helper.make_graph(
        [node], "dyn", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 8])], inits
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    where = rf"dynamic.*{op} 'mm'.*run time.*(quantize_static|quantbridge quantize)"
    for call in (lambda: qb.fold(path, tmp_path / "f.onnx"), lambda: qb.lower(path)):
        with pytest.raises(ValueError, match=where):
            call()
    feed = (_X * 10 + 128).astype(np.uint8) if op == "MatMulIntegerToFloat" else _X
    with pytest.raises(ValueError, match=where):
        qb.compare(path, inputs={"x": feed}, engines=["ort-ref"])


def test_compare_pairs_the_clipped_codes_of_sub_8_bit_qcdq(tmp_path):
    """Brevitas's 4-bit Q -> Clip -> DQ: the site is the Clip's output (what the DequantizeLinear,
    and torch's 4-bit quantizer, read). Before: compare paired the unclipped int8 Q output with
    torch's clipped value, a false first divergence at the input quantizer (measured 17 LSB on
    this input, scaled so that it clips). Now torch and ORT agree: measured 5e-7 LSB (float32
    rounding of the dequantized values), asserted 1e-3."""
    path = _brevitas_file(tmp_path / "m.onnx", "qcdq")
    result = qb.compare(path, inputs={"x": _X * 3}, engines=["ort-ref", "torch-quant"])
    assert [t["name"] for t in result.tensors] == ["xc", "rc", "y"]
    assert result.first_divergence is None
    for t in result.tensors[:2]:
        assert t["pairs"][0]["max_lsb"] < 1e-3


def test_a_file_pinned_to_batch_1_imports_at_its_own_batch(tmp_path):
    # torch's exporters write a model exported without a dynamic batch as a fixed input shape and
    # a Reshape to a constant [1, -1] (PT2E and Brevitas dynamo files: their capture failed at the
    # free batch of 2 the import tries). Built here: TorchScript export + ORT's quantize_static.
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Pinned(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = torch.nn.Conv2d(3, 8, 3), torch.nn.Linear(8 * 6 * 6, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).reshape(1, -1))

    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    float_path, path = tmp_path / "f.onnx", tmp_path / "q.onnx"
    torch.onnx.export(Pinned().eval(), (x,), float_path, dynamo=False, input_names=["x"])
    rng = np.random.default_rng(0)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": rng.standard_normal((1, 3, 8, 8), np.float32)}] * 4)

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(float_path), str(path), Reader(), quant_format=QuantFormat.QDQ)
    with pytest.warns(UserWarning, match=r"fixes its inputs' batch size \('x' \[1, 3, 8, 8\]\).*"
                      "takes that batch size only.*dynamic batch"):  # fmt: skip
        imported = qb.import_onnx(path)
    # the same int8 codes and int32 sums; what is left is float32 summation order in the Gemm
    # (measured 0.0)
    expected = _ort(path, x.numpy())
    np.testing.assert_allclose(imported(x).detach().numpy(), expected, atol=1e-5)
    with pytest.raises(ValueError, match="input 'x'.*dimension 0 is fixed to 1"):
        imported(torch.randn(2, 3, 8, 8))


@pytest.mark.parametrize("zero_type", [np.int16, np.uint16])
def test_int16_max_pool_stays_on_float_when_folded(tmp_path, zero_type):
    """ORT's A16W8 CNN (``quantize_static(activation_type=QInt16)``): the fold moved MaxPool onto
    the int16 codes (``Q -> MaxPool -> DQ``), which ONNX Runtime refuses ("Type 'tensor(int16)'
    of input parameter ... of operator (MaxPool) ... is invalid": ONNX's MaxPool takes int8 /
    uint8 only). Now it stays on the dequantized values and ORT runs the folded file to the
    original's output: identical (a maximum of the same floats)."""
    z = 0 if zero_type is np.int16 else 30000
    inits = [_const("s", 1e-3, np.float32), _const("z", z, zero_type)]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
             helper.make_node("MaxPool", ["d"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("QuantizeLinear", ["p", "s", "z"], ["pq"]),
             helper.make_node("DequantizeLinear", ["pq", "s", "z"], ["y"])]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 2, 2])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, tmp_path / "m.onnx")
    qb.fold(tmp_path / "m.onnx", tmp_path / "f.onnx")
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 4)).astype(np.float32)
    expected = _ort(tmp_path / "m.onnx", x)
    np.testing.assert_array_equal(_ort(tmp_path / "f.onnx", x, optimize=True), expected)


def _if_file(path) -> None:
    """``If(sum(x) > 0)`` whose two branches quantize (Q -> DQ -> Relu -> Q -> DQ); the main
    graph has no quantization of its own (ORT's ``EnableSubgraph``, hand-made graphs)."""

    def branch(tag: str, scale: float) -> onnx.GraphProto:
        s, z = f"s{tag}", f"z{tag}"
        nodes = [helper.make_node("QuantizeLinear", ["x", s, z], [f"q{tag}"]),
                 helper.make_node("DequantizeLinear", [f"q{tag}", s, z], [f"d{tag}"]),
                 helper.make_node("Relu", [f"d{tag}"], [f"y{tag}"])]  # fmt: skip
        inits = [_const(s, scale, np.float32), _const(z, 0, np.int8)]
        out = [helper.make_tensor_value_info(f"y{tag}", TensorProto.FLOAT, [2, 3])]
        return helper.make_graph(nodes, f"branch{tag}", [], out, inits)

    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], name="choose",
                              then_branch=branch("t", 0.02), else_branch=branch("e", 0.05))]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [_const("zero", 0.0, np.float32)],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


def test_quantization_inside_if_branches_is_named_not_called_float(tmp_path):
    """fold, lower and compare said "it is a float model" of a file that quantizes only inside
    If branches, and inspect's form was "float"; they now name the If node and say that bodies
    are not read (import already refused the If op by name)."""
    from quantbridge.debug import compare
    from quantbridge.onnx import inspect_model

    path = tmp_path / "if.onnx"
    _if_file(path)
    x = np.ones((2, 3), np.float32)
    assert _ort(path, x).shape == (2, 3)  # a valid model
    assert inspect_model(path).form == "float (quantized inside If 'choose': not read)"
    with pytest.raises(ValueError, match=r"control-flow subgraphs \(If 'choose'\).*cannot fold"):
        qb.fold(path, tmp_path / "f.onnx")
    with pytest.raises(ValueError, match=r"control-flow subgraphs \(If 'choose'\).*cannot lower"):
        qb.lower(path)
    with pytest.raises(ValueError, match=r"control-flow subgraphs \(If 'choose'\).*cannot compare"):
        compare(str(path), inputs={"x": x})
