"""``exporter._tiny_constants``: onnxscript's optimizer (run by torch's ONNX export) takes
``y + 1e-15`` for ``y`` and ``x * 1.000001`` for ``x``; the operands kept as one-element vectors
survive it, and ONNX Runtime then computes what torch computes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch
from onnxscript import optimizer

from quantbridge.onnx.exporter._tiny_constants import keep_tiny_constants


class Eps(torch.nn.Module):
    def forward(self, x, y):
        return x / (y + 1e-15) * 1.000001 + 0.5  # 0.5: a constant the optimizer keeps anyway


def _optimized(keep: bool):
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    program = torch.onnx.export(Eps().eval(), (x, y), dynamo=True, optimize=False, verbose=False)
    kept = keep_tiny_constants(program.model) if keep else 0
    return optimizer.optimize(program.model), kept


def _run(model, x, y):
    session = ort.InferenceSession(
        ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"x": x, "y": y})[0]


def test_eps_survives_the_optimizer_and_ort_matches_torch():
    x = np.array([[0.0, 1.0, -2.0], [3.0, 0.0, 0.25]], np.float32)
    y = np.array([[0.0, 2.0, 0.0], [1.0, 0.0, 4.0]], np.float32)  # 0 / (0 + eps) = 0, not NaN
    expected = Eps()(torch.from_numpy(x), torch.from_numpy(y)).numpy()
    model, kept = _optimized(keep=True)
    assert kept == 2
    assert [n.op_type for n in model.graph].count("Add") == 2
    np.testing.assert_array_equal(_run(model, x, y), expected)  # same float32 ops, same order


def test_without_it_the_optimizer_drops_the_eps():
    """The upstream behaviour the module works around (if this starts failing, onnxscript
    stopped removing near-identity constants, and ``keep_tiny_constants`` can go)."""
    model, _ = _optimized(keep=False)
    assert [n.op_type for n in model.graph].count("Add") == 1
    x = np.zeros((2, 3), np.float32)
    assert np.isnan(_run(model, x, x)).all()
