"""``qb.quantize_onnx`` / ``quantbridge quantize`` use ``qb.quantize``'s default recipe (issue 9
part 4: "through the same import, calibration and placement as PyTorch models").

Checked by outcome, not by reading signatures only: the file ``quantize_onnx`` writes with its
defaults, except that the output head is quantized too (``float_head=False``; keeping it float is
the one deliberate ONNX-only default, see ``onnx/quantizer/_head.py``), holds bit for bit the integer weights, scales and zero points of
``qb.export(qb.quantize(qb.import_onnx(f), data))`` with ``qb.quantize``'s own default, and the CLI
without ``--recipe`` writes the same file.
"""

from __future__ import annotations

import inspect

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from test_quantize_onnx import _cnn, _images

import quantbridge as qb
from quantbridge.cli import main


def _constants(model: onnx.ModelProto) -> list[tuple[str, tuple, bytes]]:
    """Every initializer as (dtype, shape, bytes), sorted: names differ between the two paths."""
    arrays = [numpy_helper.to_array(i) for i in model.graph.initializer]
    return sorted((str(a.dtype), a.shape, a.tobytes()) for a in arrays)


def test_quantize_onnx_default_recipe_is_quantize_default(tmp_path):
    default = inspect.signature(qb.quantize).parameters["recipe"].default
    assert inspect.signature(qb.quantize_onnx).parameters["recipe"].default == default
    model, images = _cnn(opset=13), _images(1, 16)
    ours = qb.quantize_onnx(model, {"input.1": images}, progress=False, float_head=False)
    qmodel = qb.quantize(qb.import_onnx(model), [torch.from_numpy(images)], progress=False)
    theirs = qb.onnx.to_onnx(qmodel, torch.from_numpy(images[:2]))
    q_ops = [n for n in ours.graph.node if n.op_type == "QuantizeLinear"]
    assert len(q_ops) >= 4  # input, two convs, gemm: a quantized file, not a float one
    assert _constants(ours) == _constants(theirs)
    # the command line without --recipe: the same file as the Python default
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", **{"input.1": images})
    out = tmp_path / "cli.onnx"
    args = ["quantize", str(tmp_path / "m.onnx"), "--calib", str(tmp_path / "calib.npz")]
    assert main([*args, "-o", str(out), "--quiet"]) == 0
    python = qb.quantize_onnx(model, {"input.1": images}, progress=False)
    assert _constants(onnx.load(str(out))) == _constants(python)
