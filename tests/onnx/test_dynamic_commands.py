"""``compare``, ``lower`` and ``fold`` on ONNX Runtime ``quantize_dynamic`` files
(DynamicQuantizeLinear + MatMulInteger; ``import_onnx`` reads them). Before the fix ``compare``
refused the file ("no quantized tensor"), ``lower`` listed DynamicQuantizeLinear and Cast among
"ops with no integer lowering", and ``fold`` called it "a float model".

``compare`` now pairs each DynamicQuantizeLinear's codes (no fixed step: the scale is computed per
input) and the float outputs. ``lower`` and ``fold`` refuse, naming the nodes and the fix: the
activation scale is computed at run time, so no integer-only program and no QLinear op exists.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from onnxruntime.quantization import QuantType, quantize_dynamic

import quantbridge as qb
from quantbridge.cli import main
from quantbridge.integer import LoweringError

X = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)


@pytest.fixture(scope="module")
def dynamic_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dynamic")
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            mlp.eval(), (torch.from_numpy(X),), str(folder / "f.onnx"), dynamo=False,
            opset_version=17, input_names=["x"], output_names=["y"],
            dynamic_axes={"x": {0: "b"}, "y": {0: "b"}},
        )  # fmt: skip
    # reduce_range: 7-bit weights, as ORT advises on x86 (its u8 x s8 kernels saturate otherwise)
    path = folder / "dyn.onnx"
    quantize_dynamic(folder / "f.onnx", path, weight_type=QuantType.QInt8, reduce_range=True)
    samples = folder / "x.npz"
    np.savez(samples, x=X)
    return path, samples


def test_compare_pairs_the_dynamic_codes_and_the_output(dynamic_file, tmp_path):
    path, samples = dynamic_file
    out = tmp_path / "cmp.json"
    engines = "ort-ref,ort,torch-quant"
    assert main(["compare", str(path), "--inputs", str(samples), "--engines", engines,
                 "--json", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert data["errors"] == {}
    tensors = {t["name"]: t for t in data["tensors"]}
    assert {"x_quantized", "/1/Relu_output_0_quantized", "y"} <= set(tensors)
    pairs = {(p["b"], t["name"]): p for t in tensors.values() for p in t["pairs"]}
    # ORT with and without graph optimizations: the same integer kernels, the same codes
    assert pairs["ort", "x_quantized"]["max_abs"] == 0.0
    # the import's DynamicQuantizer sums dequantized codes in float32 where ORT rescales the
    # exact int32 sum: float32 rounding only (measured 136 dB on the output); 100 dB bounds it
    assert pairs["torch-quant", "y"]["sqnr_db"] >= 100.0


def test_lower_refuses_naming_the_dynamic_quantizers_and_the_fix(dynamic_file, capsys):
    path, _ = dynamic_file
    with pytest.raises(
        LoweringError, match=r"cannot lower dynamic quantization: DynamicQuantizeLinear "
        r"'x_QuantizeLinear', DynamicQuantizeLinear '/1/Relu_output_0_QuantizeLinear': .* at run "
        r"time.*quantize_static"
    ):  # fmt: skip
        qb.lower(path)
    assert main(["lower", str(path), "-o", "never.onnx"]) == 2
    assert "quantbridge quantize FLOAT.onnx --calib" in capsys.readouterr().err


def test_fold_refuses_naming_the_dynamic_quantizers_and_the_fix(dynamic_file):
    path, _ = dynamic_file
    with pytest.raises(
        ValueError, match=r"dynamically quantized .*DynamicQuantizeLinear 'x_QuantizeLinear'.*"
        r"need fixed ones.*quantize_static"
    ):  # fmt: skip
        qb.onnx.fold(path)
