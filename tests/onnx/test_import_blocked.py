"""Group-wise (blocked) weights: opset-21 ``DequantizeLinear(block_size)`` and ONNX Runtime's
``MatMulNBits`` import into a trainable ``QuantModel`` and export back as blocked DQ.

Files are made in the test: with ONNX Runtime's own ``MatMulNBitsQuantizer`` (QOperator and QDQ
formats, symmetric and asymmetric) and with ``onnx.helper`` for the types, axes and partial
blocks the spec allows. ORT runs with graph optimizations off (the file's own graph).

Tolerance of the forward against ONNX Runtime: the weights are exactly the file's dequantized
values (asserted on the codes), activations are float, so the only difference is float32
summation order in the matmul. The standard bound of a float32 dot product of length ``K`` is
``gamma_K * sum |x_k| |w_k|`` with ``gamma_K = K u / (1 - K u)``, ``u = 2**-24``; we allow twice
that (our sum and ORT's each err by at most the bound), plus the bias's one rounding.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from blocked_files import K, M, N, blocked_dq_model, ort_quantized, run_ort
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb
from quantbridge.torch._fakequant import BlockWeightQuantizer

U = 2.0**-24


def _bound(x: np.ndarray, w: np.ndarray, y: np.ndarray) -> np.ndarray:
    k = x.shape[-1]
    gamma = k * U / (1 - k * U)
    return 2 * gamma * (np.abs(x) @ np.abs(w)) + 2 * U * np.abs(y)


def _block_quantizers(qm) -> list[BlockWeightQuantizer]:
    return [q for q in qm.modules() if isinstance(q, BlockWeightQuantizer)]


def _file_weight(model: onnx.ModelProto) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Codes [K, N], scales and zero points [blocks, N] of the file's one weight."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type in ("DequantizeLinear", "MatMulNBits"))
    if node.op_type == "DequantizeLinear":
        zero = inits[node.input[2]].astype(np.int64) if len(node.input) > 2 else None
        return inits[node.input[0]].astype(np.int64), inits[node.input[1]], zero
    from quantbridge.onnx.importer._nbits import unpack_low_first

    packed, scale = inits[node.input[1]], inits[node.input[2]]
    codes = unpack_low_first(packed.reshape(N, -1), 4, packed.shape[1] * 32)[:, :K]
    zero = None
    if len(node.input) > 3:
        zero = unpack_low_first(inits[node.input[3]].reshape(N, -1), 4, scale.shape[1]).T
    return codes.T, scale.reshape(N, -1).T, zero


@pytest.mark.parametrize("fmt", ["qdq", "nbits"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_onnxruntime_block_quantizer_files_import_train_and_export(fmt, symmetric, tmp_path):
    model = ort_quantized(fmt, symmetric)
    ops = {n.op_type for n in model.graph.node}
    assert ("MatMulNBits" if fmt == "nbits" else "DequantizeLinear") in ops
    codes, scale, zero = _file_weight(model)
    x = np.random.default_rng(1).standard_normal((M, 3, K)).astype(np.float32)
    qm = qb.import_onnx(model)
    (wq,) = _block_quantizers(qm)
    assert (wq.block_size, wq.axis, wq.scheme.bits) == (32, 1, 4)  # nn.Linear's [N, K]: axis 1
    w = qm.get_parameter(wq.weight_name)
    np.testing.assert_array_equal(wq.quantize_integers(w).numpy(), codes.T)  # the file's codes
    with torch.no_grad():
        y = qm(torch.from_numpy(x)).numpy()
    ref = run_ort(model, x)
    values = (codes - (8 if zero is None and fmt == "nbits" else 0 if zero is None else zero.repeat(32, 0)[:K])) * scale.repeat(32, 0)[:K]  # fmt: skip
    assert np.all(np.abs(y - ref) <= _bound(x, values, ref))

    exported = qb.export(qm, tmp_path / "rt.onnx", torch.from_numpy(x))
    dq = next(n for n in exported.graph.node if n.op_type == "DequantizeLinear")
    attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
    assert attrs == {"axis": 0, "block_size": 32}  # the file's [K, N] layout (ORT fuses it)
    assert next(o.version for o in exported.opset_import if o.domain == "") == 21
    inits = {i.name: i for i in exported.graph.initializer}
    assert inits[dq.input[0]].data_type in (TensorProto.INT4, TensorProto.UINT4)
    np.testing.assert_array_equal(numpy_helper.to_array(inits[dq.input[0]]).astype(int), codes)
    np.testing.assert_array_equal(numpy_helper.to_array(inits[dq.input[1]]), scale)
    if zero is not None:
        got_zero = numpy_helper.to_array(inits[dq.input[2]]).astype(int)
        np.testing.assert_array_equal(got_zero, zero)
    assert not any(n.op_type == "Transpose" for n in exported.graph.node)
    again = run_ort(exported, x)
    assert np.all(np.abs(again - ref) <= _bound(x, values, ref))

    qm.train()  # one optimiser step moves the weights; they stay on the file's grid
    opt = torch.optim.SGD(qm.parameters(), lr=0.5)
    before = w.detach().clone()
    qm(torch.from_numpy(x)).pow(2).mean().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    opt.step()
    assert not torch.equal(w.detach(), before)
    fq = wq(w).detach()
    np.testing.assert_array_equal(
        fq.numpy(), qb.numerics.dequantize(wq.quantize_integers(w), wq.scale, wq.zero_point, 1, 32)
    )


@pytest.mark.parametrize(
    "onnx_type, lo, hi",
    [(TensorProto.INT4, -8, 7), (TensorProto.UINT4, 0, 15), (TensorProto.INT8, -128, 127),
     (TensorProto.UINT8, 0, 255)],
)  # fmt: skip
@pytest.mark.parametrize("axis, block", [(0, 32), (1, 16), (1, 7)])
def test_blocked_dequantize_linear_types_and_axes(onnx_type, lo, hi, axis, block, tmp_path):
    model, file = blocked_dq_model(onnx_type, lo, hi, axis, block)
    x = np.random.default_rng(4).standard_normal((M, K)).astype(np.float32)
    qm = qb.import_onnx(model)
    (wq,) = _block_quantizers(qm)
    assert (wq.axis, wq.block_size) == (1 - axis, block)
    w = qm.get_parameter(wq.weight_name)
    np.testing.assert_array_equal(wq.quantize_integers(w).numpy(), file["codes"].T)
    with torch.no_grad():
        y = qm(torch.from_numpy(x)).numpy()
    ref = run_ort(model, x)
    values = qb.numerics.dequantize(file["codes"], file["scale"], file["zero"], axis, block)
    assert np.all(np.abs(y - ref) <= _bound(x, values, ref))
    exported = qb.onnx.to_onnx(qm, torch.from_numpy(x))
    inits = {i.name: numpy_helper.to_array(i) for i in exported.graph.initializer}
    dq = next(n for n in exported.graph.node if n.op_type == "DequantizeLinear")
    # written back in the file's layout: same codes, scales, zero points and axis
    np.testing.assert_array_equal(inits[dq.input[0]].astype(int), file["codes"])
    np.testing.assert_array_equal(inits[dq.input[1]], file["scale"])
    np.testing.assert_array_equal(inits[dq.input[2]].astype(int), file["zero"])
    attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
    assert attrs == {"axis": axis, "block_size": block}
    np.testing.assert_array_equal(run_ort(exported, x), ref)  # the same graph, values bit for bit


def test_blocked_conv_weight_along_input_channels():
    rng = np.random.default_rng(5)
    codes = rng.integers(-8, 8, (4, 6, 3, 3))
    scale = rng.uniform(0.01, 0.1, (4, 2, 3, 3)).astype(np.float32)  # blocks of 4: 4 + 2
    nodes = [
        helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"], axis=1, block_size=4),
        helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 5, 5])],
        [helper.make_tensor("wq", TensorProto.INT4, codes.shape, codes.reshape(-1).tolist()),
         numpy_helper.from_array(scale, "ws")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    qm = qb.import_onnx(model)
    (wq,) = _block_quantizers(qm)
    assert (wq.axis, wq.block_size, wq.scheme.signed) == (1, 4, True)
    np.testing.assert_array_equal(wq.quantize_integers(qm.get_parameter(wq.weight_name)), codes)
    x = np.random.default_rng(6).standard_normal((1, 6, 5, 5)).astype(np.float32)
    with torch.no_grad():
        y = qm(torch.from_numpy(x)).numpy()
    ref = run_ort(model, x)
    w = qb.numerics.dequantize(codes, scale, np.zeros_like(codes[:, :2]), 1, 4)
    # a conv output is a dot product of length 6 * 9: the bound with |w| at its largest
    k = 6 * 9
    bound = 2 * k * U / (1 - k * U) * k * np.abs(x).max() * np.abs(w).max()
    assert np.abs(y - ref).max() <= bound


def test_refusals_name_the_node_and_the_fix():
    blocked = qb.QScheme(4, True, True, False, qb.numerics.PerBlock(0, 32))
    with pytest.raises(ValueError, match="per-block .* only from imported files"):
        qb.Recipe(weights=qb.TensorRecipe(blocked))  # calibration does not choose blocks
    model, _ = blocked_dq_model(TensorProto.INT4, -8, 7, 0, 32)
    with pytest.raises(ValueError, match="group-wise .* needs opset >= 21; pass opset=21"):
        qb.onnx.to_onnx(qb.import_onnx(model), torch.zeros(2, K), opset=18)
    with pytest.raises(ValueError, match="learning the scales .* not supported for blocked"):
        qb.import_onnx(model, learn_scales=True)
    # a blocked Q / DQ of an activation
    act = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s"], ["q"], axis=1, block_size=2),
         helper.make_node("DequantizeLinear", ["q", "s"], ["y"], axis=1, block_size=2)],
        "act", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(np.full((1, 2), 0.1, np.float32), "s")],
    )  # fmt: skip
    act_model = helper.make_model(act, opset_imports=[helper.make_opsetid("", 21)])
    with pytest.raises(ValueError, match=r"QuantizeLinear\).*run-time tensor 'x'.*per tensor"):
        qb.import_onnx(act_model)
    # MatMulNBits with g_idx (act-order)
    nbits = ort_quantized("nbits", True)
    node = next(n for n in nbits.graph.node if n.op_type == "MatMulNBits")
    node.input.extend(["", "g_idx"])
    nbits.graph.initializer.append(numpy_helper.from_array(np.arange(K, dtype=np.int32), "g_idx"))
    with pytest.raises(ValueError, match="MatMulNBits.*g_idx .* not supported"):
        qb.import_onnx(nbits)


def test_matmulnbits_file_at_opset_18_exports_at_21():
    # regression: the QuantModel kept the file's opset (18, as ONNX Runtime leaves a MatMulNBits
    # file) and export refused ("needs opset >= 21") unless the user passed opset=21
    model = ort_quantized("nbits", True)
    for o in model.opset_import:
        if o.domain == "":
            o.version = 18
    qm = qb.import_onnx(model)
    exported = qb.onnx.to_onnx(qm, torch.zeros(2, 3, K))
    assert next(o.version for o in exported.opset_import if o.domain == "") == 21
