"""A model imported from ONNX Runtime's ``quantize_dynamic`` keeps its dynamic quantizers
(``torch/_dynamic.DynamicQuantizer``) through ``float_mode``, ``qb.save`` / ``qb.load`` and export
(issue 9: "dynamic imports keep a custom per-call quantizer"; before, float_mode did not bypass it
and export was refused).

Agreement: the result of a dynamically quantized layer is float (no output grid), so the bound is
float32 rounding: ORT rescales the exact int32 sum, the import sums dequantized values in float32;
measured <= 5e-7 of the largest output (``test_import_quantized.test_dynamic_matches_ort``), bound
1e-5. reduce_range=True (7-bit weights) as ORT advises on x86: without it ORT's AVX2 u8 x s8
kernels saturate.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from test_import_quantized import (
    MODELS,
    _batches,
    _same_arrays,
    float_file,
    ort_dynamic,
    run_ort,
)

import quantbridge as qb
from quantbridge.torch._dynamic import DynamicQuantizer


def _weights(model: onnx.ModelProto) -> list[np.ndarray]:
    """int8 / uint8 initializers of >= 2 dims: the layers' integer weights."""
    arrays = [onnx.numpy_helper.to_array(i) for i in model.graph.initializer]
    return [a.astype(np.int64) for a in arrays if a.ndim >= 2 and a.dtype in (np.int8, np.uint8)]


def _ort_dynamic_quantize(x: np.ndarray) -> np.ndarray:
    """ONNX Runtime's DynamicQuantizeLinear -> DequantizeLinear of ``x``: the reference."""
    graph = helper.make_graph(
        [
            helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
        ],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape))],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("spread", [1e-3, 1.0, 300.0])
def test_dynamic_quantizer_is_ort_dynamic_quantize_linear_and_float_mode_bypasses_it(spread):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 33)) * spread + spread / 3).astype(np.float32)
    q = DynamicQuantizer("x")
    got = q(torch.from_numpy(x)).numpy()
    # ORT computes 1/scale once and multiplies; torch divides: a value may land 1 code apart
    # where x / s sits within float32 rounding of a .5 tie. Scale = the range / 255
    step = (max(x.max(), 0) - min(x.min(), 0)) / 255
    assert np.abs(got - _ort_dynamic_quantize(x)).max() <= step * (1 + 1e-3)
    assert (np.abs(got - _ort_dynamic_quantize(x)) > 1e-3 * step).mean() <= 0.01
    with qb.float_mode(torch.nn.Sequential(q)):
        assert torch.equal(q(torch.from_numpy(x)), torch.from_numpy(x))


@pytest.mark.parametrize("name", ["digits", "block"])  # ConvInteger + MatMulInteger / MatMul only
def test_dynamic_import_round_trips(name, tmp_path):
    make, shape = MODELS[name]
    src = float_file(make(), torch.randn(2, *shape), tmp_path / "float.onnx")
    path = ort_dynamic(src, tmp_path / "dyn.onnx", per_channel=True)
    qmodel = qb.import_onnx(path)
    dynamic = [q for q in qmodel._all_quantizers() if isinstance(q, DynamicQuantizer)]
    assert dynamic and {q.name for q in dynamic} <= set(qmodel.quantizers())
    x = np.concatenate(_batches(shape, 2, 7))
    xt = torch.from_numpy(x)
    with torch.no_grad():
        y = qmodel(xt)
        with qb.float_mode(qmodel):  # every quantizer bypassed, the dynamic ones included
            assert not any(q.enabled for q in dynamic)
            y_float = qmodel(xt)
    assert not torch.equal(y, y_float)
    # qb.save / qb.load: bit-identical
    qb.save(qmodel, tmp_path / "m.qb")
    loaded = qb.load(tmp_path / "m.qb", qb.import_onnx(path))
    with torch.no_grad():
        assert torch.equal(loaded(xt), y)
    # export: DynamicQuantizeLinear again, the file's integer weights, ORT agrees
    out = tmp_path / "again.onnx"
    qb.export(qmodel, out, example_inputs=xt[:2])
    written = onnx.load(str(out))
    dql = [n for n in written.graph.node if n.op_type == "DynamicQuantizeLinear"]
    assert len(dql) == len(dynamic)
    theirs = _weights(onnx.load(path))
    ours = _weights(written)
    assert _same_arrays(ours, theirs)  # one to one, bit for bit (MatMul weights transposed)
    expected = run_ort(path, x, optimize=True)
    got = run_ort(str(out), x, optimize=False)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    assert np.abs(got - y.numpy()).max() <= 1e-5 * np.abs(expected).max()
