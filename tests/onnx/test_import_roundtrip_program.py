"""Issue 9's round-trip invariant on the structure of the PP-OCRv4 detector: importing a QDQ file
and exporting it again reproduces the file's integer program (``qb.lower``), so
``integer_mode(import_onnx(f))`` computes exactly what ``qb.lower(f)`` computes.

The detector's hard-swish blocks are ``x * a + b`` (a folded BatchNorm's scale and shift as
size-1 constants), ``(x + 3).clip(0, 6) / 6 * x``; its SE blocks a global mean, two 1 x 1 convs
and a hard-sigmoid (``x * 0.2 + 0.5``) that gates the features. ``quantize_onnx`` writes each
size-1 constant of a quantized Add / Mul as ``DequantizeLinear(uint8 code)``. The import used to
read those as python floats and export them as float constants, so the re-exported file fused
each chain into a lookup table (one rounding) where the file rounds after every op: 13.9% of the
detector's output probabilities differed (2 pages 160 x 160). Now each such constant imports with
a ``ConstantQuantizer`` on the file's grid and export writes its code back.

Reference: the integer program of the original file (``qb.lower``, numpy executor), compared
bit for bit (0 LSB: the same integer program must give the same integers).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from test_import_quantized import float_file

import quantbridge as qb
from quantbridge.torch._fakequant import ConstantQuantizer


class _HardSwishSE(torch.nn.Module):
    """conv -> affine -> hard-swish -> SE (mean, conv, relu, conv, hard-sigmoid, gate) -> conv."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.squeeze = torch.nn.Conv2d(8, 4, 1)
        self.excite = torch.nn.Conv2d(4, 8, 1)
        self.head = torch.nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x) * 0.9431 + 0.5043
        y = torch.clamp(y + 3.0, 0.0, 6.0) / 6.0 * y
        s = torch.relu(self.squeeze(y.mean(dim=(2, 3), keepdim=True)))
        s = torch.clamp(self.excite(s) * 0.2 + 0.5, 0.0, 1.0)
        return self.head(y * s)


def _scalar_constants(model: onnx.ModelProto) -> list[tuple]:
    """(code, scale, zero point) of every size-1 integer constant read by a DequantizeLinear."""
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    found = []
    for n in model.graph.node:
        v = consts.get(n.input[0])
        if n.op_type == "DequantizeLinear" and v is not None and v.size == 1:
            scale, zero = consts[n.input[1]], consts[n.input[2]]
            found.append((int(v), float(scale), int(zero), v.dtype.name))
    return sorted(found)


def test_export_of_the_import_reproduces_the_integer_program(tmp_path):
    torch.manual_seed(0)
    src = float_file(_HardSwishSE().eval(), torch.randn(2, 3, 16, 16), tmp_path / "f.onnx")
    rng = np.random.default_rng(0)
    calib = {"x": rng.standard_normal((8, 3, 16, 16)).astype(np.float32)}
    path = tmp_path / "q.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-VNNI advice: "native" already follows it
        qb.quantize_onnx(src, calib, path, recipe="native", progress=False, float_head=False)
    file_constants = _scalar_constants(onnx.load(str(path)))
    assert len(file_constants) >= 5  # a, b, 3, 0.2, 0.5: the constants of the quantized ops

    qmodel = qb.import_onnx(path)
    constants = [q for q in qmodel._all_quantizers() if isinstance(q, ConstantQuantizer)]
    assert len(constants) == len(file_constants)
    x = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)
    again = tmp_path / "again.onnx"
    qb.export(qmodel, again, example_inputs=torch.from_numpy(x))
    assert _scalar_constants(onnx.load(str(again))) == file_constants  # codes, scales, zeros

    shapes = {"x": x.shape}
    program = qb.lower(path, input_shapes=shapes)
    (expected,) = program.run({"x": x}, integer=True).values()
    (got,) = qb.lower(again, input_shapes=shapes).run({"x": x}, integer=True).values()
    np.testing.assert_array_equal(got, expected)
    assert qb.lower(again, input_shapes=shapes).op_counts() == program.op_counts()
    with qb.integer_mode(qmodel):
        y = qmodel(torch.from_numpy(x))
    np.testing.assert_array_equal(y.numpy(), program.run({"x": x})["y"])
