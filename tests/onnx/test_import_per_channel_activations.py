"""Per-channel activation grids import (regression sweep, 2026-12-02).

NNCF (``nncf.quantize`` on an ONNX MobileNetV2, its default preset) quantizes the input of every
depthwise conv per channel: ``QuantizeLinear(x, scales[C], zero_points[C], axis=1) ->
DequantizeLinear(axis=1) -> Conv(group=C)``. Before the fix the import refused every such file
("per-channel quantization of a run-time tensor ... is not supported"). The file here is that
pattern written by hand (NNCF is not a test dependency), with a data-movement case that stays
refused with the fix named.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb

C = 4


def _file(between: str | None = None) -> onnx.ModelProto:
    """x -> Q/DQ per channel (axis 1, scales differing by 30x as NNCF's do) -> depthwise 3x3
    conv (int8 per-channel weights, float bias) -> y. ``between``: a data-movement op on the
    integers between the Q and the DQ."""
    rng = np.random.default_rng(0)
    scales = np.array([0.002, 0.01, 0.03, 0.06], np.float32)
    zeros = np.array([0, 3, -2, 0], np.int8)
    w = rng.integers(-127, 128, (C, 1, 3, 3)).astype(np.int8)
    w_scale = np.array([0.01, 0.02, 0.005, 0.03], np.float32)
    inits = [
        numpy_helper.from_array(scales, "s"), numpy_helper.from_array(zeros, "z"),
        numpy_helper.from_array(w, "w"), numpy_helper.from_array(w_scale, "ws"),
        numpy_helper.from_array(np.zeros(C, np.int8), "wz"),
        numpy_helper.from_array(rng.standard_normal(C).astype(np.float32), "b"),
    ]  # fmt: skip
    q_out = "xq"
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], axis=1)]
    if between is not None:
        nodes.append(helper.make_node(between, ["xq"], ["xm"], perm=[0, 1, 3, 2]))
        q_out = "xm"
    nodes += [
        helper.make_node("DequantizeLinear", [q_out, "s", "z"], ["xd"], axis=1),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("Conv", ["xd", "wd", "b"], ["y"], group=C, pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes, "nncf_depthwise",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", C, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", C, 8, 8])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def test_per_channel_activation_grid_matches_ort(tmp_path):
    """Import, ORT on the file, export of the import: the same codes per channel. Both compute
    the conv in float32 on the same dequantized values; only the summation order differs:
    <= 1e-5 of the largest output."""
    model = _file()
    qmodel = qb.import_onnx(model.SerializeToString())
    x = np.random.default_rng(1).standard_normal((3, C, 8, 8)).astype(np.float32)
    x *= np.array([0.2, 1.0, 3.0, 6.0], np.float32).reshape(1, C, 1, 1)  # each channel's range
    with torch.no_grad():
        y = qmodel(torch.from_numpy(x)).numpy()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = sess.run(None, {"x": x})[0]
    tol = 1e-5 * np.abs(expected).max()
    assert np.abs(y - expected).max() <= tol
    path = tmp_path / "again.onnx"
    qb.export(qmodel, path, example_inputs=torch.from_numpy(x))
    again = onnx.load(str(path))
    (q,) = [n for n in again.graph.node if n.op_type == "QuantizeLinear"]
    consts = {i.name: numpy_helper.to_array(i) for i in again.graph.initializer}
    np.testing.assert_array_equal(
        consts[q.input[1]].reshape(-1), np.float32([0.002, 0.01, 0.03, 0.06])
    )  # the file's float32 scales, bit for bit
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert np.abs(sess.run(None, {sess.get_inputs()[0].name: x})[0] - y).max() <= tol


def test_per_channel_grid_moved_across_channels_is_refused():
    with pytest.raises(ValueError, match=r"Transpose.*per channel along axis 1.*dequantize before"):
        qb.import_onnx(_file(between="Transpose").SerializeToString())
