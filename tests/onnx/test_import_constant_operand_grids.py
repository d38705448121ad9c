"""An Add / Mul whose other operand is an initializer: ONNX Runtime's ``quantize_static`` stores
that initializer as uint8 codes (QDQ: ``DQ(codes) -> Mul``; QOperator: QLinearMul / QLinearAdd's
B input). The import gives it a ``ConstantQuantizer`` on the file's grid (it used to import as a
float constant), so ``export(import(f))`` writes the file's codes, scale and zero point again.

Agreement: against ONNX Runtime with graph optimisations off on the QDQ file (node by node, the
float simulation the file specifies; the QOperator file runs ORT's integer kernels even then,
which saturate u8 x s8 pair sums on this CPU without VNNI), within 1 step of the output grid on
every element (float accumulation order can cross a rounding boundary; measured 0).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from test_import_quantized import _batches, _output_step, float_file, ort_static, run_ort

import quantbridge as qb
from quantbridge.torch._fakequant import ConstantQuantizer


class _ScaleShift(torch.nn.Module):
    """conv, then a per-channel scale and shift held as tensors (Mul / Add by initializers)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.gamma = torch.nn.Parameter(torch.rand(1, 8, 1, 1) + 0.5)
        self.beta = torch.nn.Parameter(torch.randn(1, 8, 1, 1))

    def forward(self, x):
        return torch.relu(self.conv(x) * self.gamma + self.beta)


def _codes(model: onnx.ModelProto) -> list[tuple]:
    """(codes, scale, zero point) of every 4-D uint8 constant of shape (1, C, 1, 1) read by a
    DequantizeLinear or a QLinear op: gamma and beta."""
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    found = []
    for n in model.graph.node:
        if n.op_type not in ("DequantizeLinear", "QLinearMul", "QLinearAdd"):
            continue
        i = 0 if n.op_type == "DequantizeLinear" else 3
        v = consts.get(n.input[i])
        if v is not None and v.dtype == np.uint8 and v.shape == (1, 8, 1, 1):
            scale, zero = consts[n.input[i + 1]], consts[n.input[i + 2]]
            found.append((v.tobytes(), float(scale), int(zero)))
    return sorted(found)


@pytest.mark.parametrize("fmt", ["QDQ", "QOperator"])
def test_constant_operands_keep_the_file_grid(fmt, tmp_path):
    torch.manual_seed(0)
    src = float_file(_ScaleShift().eval(), torch.randn(2, 3, 8, 8), tmp_path / "f.onnx")
    batches = _batches((3, 8, 8), 3, 1)
    path = ort_static(src, tmp_path / f"{fmt}.onnx", batches, fmt, True)
    qdq = ort_static(src, tmp_path / "ref.onnx", batches, "QDQ", True)  # ORT's reference form
    assert len(_codes(onnx.load(path))) == 2
    qmodel = qb.import_onnx(path)
    constants = [q for q in qmodel._all_quantizers() if isinstance(q, ConstantQuantizer)]
    assert len(constants) == 2 and all(q.name in qmodel.quantizers() for q in constants)
    x = np.concatenate(_batches((3, 8, 8), 2, 5))
    with torch.no_grad():
        y = qmodel(torch.from_numpy(x)).numpy()
    reference = run_ort(qdq, x, optimize=False)
    assert (np.abs(y - reference) / _output_step(qdq)).max() <= 1.0 + 1e-3
    out = tmp_path / "again.onnx"
    qb.export(qmodel, out, example_inputs=torch.from_numpy(x[:2]))
    assert _codes(onnx.load(str(out))) == _codes(onnx.load(path))  # codes, scales, zero points
    again = run_ort(str(out), x, optimize=False)
    assert (np.abs(again - reference) / _output_step(qdq)).max() <= 1.0 + 1e-3
