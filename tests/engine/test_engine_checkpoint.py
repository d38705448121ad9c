"""``qb.save``/``qb.load`` of an engine model (issue 15 part 4): ONNX bytes and the signature in
one safetensors file, no pickle; loading refuses what does not match, as checkpoints do."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import quantbridge as qb
from quantbridge.torch import CheckpointError


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x, bias):
        return self.fc2(self.fc1(x).relu()) + bias, x.sum(1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    x, bias = torch.randn(5, 6), torch.randn(5, 3)
    qmodel = qb.quantize(Small().eval(), [(x, bias)], recipe="int8")
    fast = qb.to_engine(qmodel, "onnxruntime", example_inputs=(x, bias), threads=1)
    path = tmp_path_factory.mktemp("engine") / "m.qb"
    qb.save(fast, path)
    return fast, path, (x, bias)


def test_load_gives_the_same_outputs_and_both_forms(saved):
    fast, path, (x, bias) = saved
    loaded = qb.load(path)
    assert isinstance(loaded, qb.EngineModel) and loaded.forms == ["int8", "fp32"]
    assert repr(loaded) == repr(fast)
    for a, b in zip(loaded(x, bias), fast(x, bias), strict=True):
        assert torch.equal(a, b)  # the same bytes in the same engine: exact
    with qb.float_mode(loaded), qb.float_mode(fast):
        assert torch.equal(loaded(x, bias=bias)[0], fast(x, bias)[0])
    assert qb.load(path, Small()).precision == "int8"  # a model of the saved class is accepted


def test_the_file_is_safetensors_with_onnx_bytes_and_no_pickle(saved):
    fast, path, _ = saved
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert sorted(f.keys()) == ["onnx.fp32", "onnx.int8"]
        assert f.get_tensor("onnx.int8").numpy().tobytes() == fast.onnx_bytes(True)
    header = json.loads(meta["quantbridge"])
    assert meta["format"] == "quantbridge-engine" and header["engine"] == "onnxruntime"
    assert header["threads"] == 1 and header["source_class"] == "Small"
    assert not path.read_bytes().startswith(b"\x80")  # not a pickle


def test_the_float_and_int8_switch_state_is_saved(saved, tmp_path):
    fast, _, (x, bias) = saved
    fast.set_quantization(False)
    try:
        qb.save(fast, tmp_path / "f.qb")
    finally:
        fast.set_quantization(True)
    assert qb.load(tmp_path / "f.qb").precision == "fp32"


def test_load_refuses_mismatches(saved, tmp_path):
    _, path, _ = saved
    with pytest.raises(CheckpointError, match="made from a Small, not a Linear; load it with"):
        qb.load(path, nn.Linear(2, 2))
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors["onnx.int8"][100] ^= 1  # one flipped bit
    save_file(tensors, str(tmp_path / "bad.qb"), metadata=meta)
    with pytest.raises(CheckpointError, match="onnx.int8 does not match the checksum"):
        qb.load(tmp_path / "bad.qb")
    save_file(load_file(str(path)), str(tmp_path / "new.qb"), {**meta, "format_version": "9"})
    with pytest.raises(CheckpointError, match="format '9'; this quantbridge reads format 1"):
        qb.load(tmp_path / "new.qb")
    save_file(load_file(str(path)), str(tmp_path / "nohead.qb"), {"format": meta["format"],
              "format_version": "1"})  # fmt: skip
    with pytest.raises(CheckpointError, match="corrupted: its header lacks"):
        qb.load(tmp_path / "nohead.qb")


def test_a_quantmodel_checkpoint_still_needs_its_model(tmp_path):
    torch.manual_seed(0)
    x, bias = torch.randn(5, 6), torch.randn(5, 3)
    qmodel = qb.quantize(Small().eval(), [(x, bias)], recipe="int8")
    qb.save(qmodel, tmp_path / "q.qb")
    with pytest.raises(TypeError, match=r"fresh instance .* pass model=Small\(\) \(a fresh "):
        qb.load(tmp_path / "q.qb")
    assert isinstance(qb.load(tmp_path / "q.qb", Small()), qb.QuantModel)


def test_load_in_a_fresh_process_imports_the_engine_layer_itself(saved):
    """``import quantbridge`` leaves the engine layer unloaded (tests/test_import_time.py); the
    engine checkpoint's loader registers when that layer is imported, so ``qb.load`` imports it
    on the first engine file (``FORMAT_MODULES``)."""
    fast, path, (x, bias) = saved
    code = (
        "import sys, torch, quantbridge as qb\n"
        "assert 'quantbridge.engine' not in sys.modules\n"
        f"m = qb.load({str(path)!r})\n"
        "x, bias = torch.load(sys.argv[1])\n"
        "print(type(m).__name__, float(m(x, bias)[0].sum()))\n"
    )
    torch.save((x, bias), path.with_suffix(".pt"))
    out = subprocess.run([sys.executable, "-c", code, str(path.with_suffix(".pt"))],
                         capture_output=True, text=True, check=True)  # fmt: skip
    name, total = out.stdout.split()
    assert name == "EngineModel" and float(total) == float(fast(x, bias)[0].sum())
