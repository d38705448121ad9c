"""Issue 13, the first hour of a new user: each test is a call as a user makes it, asserting on the
one-line message or the result they get.

Parts 1-2 (calibration data and shapes as users pass them): a batch that does not fit ``forward``,
a wrong size, rank or dtype at call time, at export or in calibration is one line naming the input,
the expected and received shape and the ``dynamic=`` option; float64 data is cast, said once.

Part 6 (import_onnx errors): a file that is not ONNX is a ValueError naming the file; a shape
error at run time names the ONNX node, as ONNX Runtime does.

Part 8 (quiet by default): ``qb.export`` from Python prints nothing of torch's, LSQ export warns
nothing foreign, and our own warnings point at the user's line.

Part 10 (a self-contained repository): the PP-OCR models come from the package registry, the test
extra holds every engine the tests use, the README links only files in the repository, ``qb.save``
honours the umask, ``python -m bench --help`` speaks to users.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from ppocr_models import SHA256, ppocr_dir, skip_reason
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import quantbridge as qb

ROOT = Path(__file__).resolve().parents[1]


def _linear_qmodel() -> qb.QuantModel:
    return qb.quantize(nn.Sequential(nn.Linear(4, 4)).eval(), [torch.randn(2, 4)], progress=False)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


@pytest.fixture(scope="module")
def cnn_q():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    return model, qb.quantize(model, [torch.randn(4, 3, 32, 32) for _ in range(2)], progress=False)


# -- part 1 ------------------------------------------------------------------------------------------
def test_dataloader_of_inputs_and_labels_names_the_transform():
    loader = DataLoader(TensorDataset(torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16,))), 4)
    with pytest.raises(TypeError) as info:
        qb.quantize(SmallCNN().eval(), loader, progress=False)
    message = str(info.value)
    assert message.startswith(
        "calibration batch 0 (float32[4, 3, 32, 32], int64[4]) does not fit SmallCNN.forward(x): "
        "too many positional arguments."
    )
    assert "pass transform=lambda b: b[0]" in message
    assert "torch.export" not in message and ".item()" not in message  # no capture advice
    qmodel = qb.quantize(SmallCNN().eval(), loader, transform=lambda b: b[0], progress=False)
    assert qmodel(torch.randn(2, 3, 32, 32)).shape == (2, 4)


# -- part 2 ------------------------------------------------------------------------------------------
WRONG_SIZE = (
    "input 'x': expected shape [batch, 3, 32, 32], got [4, 3, 64, 64]: dimension 2 is fixed to "
    '32; quantize with dynamic="all" to accept other sizes (it used dynamic="batch")'
)


def test_call_with_another_image_size_names_input_shapes_and_option(cnn_q):
    with pytest.raises(ValueError) as info:
        cnn_q[1](torch.randn(4, 3, 64, 64))
    assert str(info.value) == WRONG_SIZE


def test_export_with_another_image_size_gives_the_same_line(cnn_q, tmp_path):
    with pytest.raises(ValueError) as info:
        qb.export(cnn_q[1], tmp_path / "m.onnx", example_inputs=torch.randn(4, 3, 64, 64))
    assert str(info.value) == WRONG_SIZE


def test_calibration_batch_of_another_size_names_batch_and_input():
    data = [torch.randn(4, 3, 32, 32), torch.randn(4, 3, 64, 64)]
    with pytest.raises(ValueError) as info:
        qb.quantize(SmallCNN().eval(), data, progress=False)
    assert str(info.value) == f"calibration batch 1: {WRONG_SIZE}"
    assert "s7" not in str(info.value) and "Guard" not in str(info.value)


def test_wrong_rank_and_dtype_at_call_time(cnn_q):
    qmodel = qb.quantize(cnn_q[0], [torch.randn(4, 3, 32, 32)], progress=False, dynamic="all")
    with pytest.raises(ValueError) as info:
        qmodel(torch.randn(3, 32, 32))
    assert str(info.value) == "input 'x': expected 4 dimensions [batch, *, *, *], got 3 [3, 32, 32]"
    with pytest.raises(ValueError) as info:
        qmodel(torch.randn(2, 3, 32, 32, dtype=torch.float64))
    assert str(info.value) == (
        "input 'x' is float64[2, 3, 32, 32]; the model was captured with "
        "float32[batch, *, *, *]: pass x.to(torch.float32)"
    )


def test_static_capture_suggests_the_batch_option(cnn_q):
    qmodel = qb.quantize(cnn_q[0], [torch.randn(4, 3, 32, 32)], progress=False, dynamic="none")
    with pytest.raises(
        ValueError, match=r'dimension 0 is fixed to 4; quantize with dynamic="batch"'
    ):
        qmodel(torch.randn(2, 3, 32, 32))


def test_loaded_model_checks_its_inputs_too(cnn_q, tmp_path):
    qb.save(cnn_q[1], tmp_path / "m.qb")
    loaded = qb.load(tmp_path / "m.qb", model=SmallCNN())
    with pytest.raises(ValueError) as info:
        loaded(torch.randn(4, 3, 64, 64))
    assert str(info.value) == WRONG_SIZE


def test_float64_calibration_data_is_cast_and_said_once(cnn_q):
    data = [torch.randn(4, 3, 32, 32, dtype=torch.float64) for _ in range(3)]
    with pytest.warns(UserWarning, match="casting the batches to float32") as caught:
        qmodel = qb.quantize(cnn_q[0], data, progress=False)
    ours = [w for w in caught if "casting the batches" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__  # points at the quantize call
    x = data[0].float()
    reference = qb.quantize(cnn_q[0], [d.float() for d in data], progress=False)
    torch.testing.assert_close(qmodel(x), reference(x), rtol=0, atol=0)  # same scales, same ints


# -- part 6 ------------------------------------------------------------------------------------------
def test_import_of_a_file_that_is_not_onnx_names_the_file(tmp_path):
    path = tmp_path / "README.onnx"
    path.write_text("# not a model\n")
    with pytest.raises(ValueError) as info:
        qb.import_onnx(path)
    assert str(info.value).startswith(f"import_onnx({str(path)!r}): not an ONNX model (protobuf: ")


def test_runtime_shape_error_names_the_onnx_node_as_onnxruntime_does(tmp_path):
    bias = numpy_helper.from_array(np.ones((1, 3, 4, 4), np.float32), "bias")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "bias"], ["y"], name="p2o.Add.248")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [bias],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.save(proto, tmp_path / "m.onnx")
    x = np.zeros((1, 3, 5, 5), np.float32)
    with pytest.raises(Exception, match=r"Name:'p2o\.Add\.248'"):  # the peer's wording
        ort.InferenceSession(tmp_path / "m.onnx").run(None, {"x": x})
    model = qb.import_onnx(tmp_path / "m.onnx")
    with pytest.raises(RuntimeError) as info:
        model(torch.from_numpy(x))
    assert str(info.value).startswith("ONNX node 'p2o.Add.248' (Add): The size of tensor a (5)")
    assert model(torch.ones(1, 3, 4, 4)).eq(2).all()  # the right size still runs


# -- part 8 ------------------------------------------------------------------------------------------
def test_python_export_prints_nothing(cnn_q, tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(logging.getLogger("torch.onnx"), "level", logging.WARNING)  # as for users
    capfd.readouterr()
    qb.export(cnn_q[1], tmp_path / "m.onnx", example_inputs=torch.randn(2, 3, 32, 32))
    out, err = capfd.readouterr()
    assert out == "" and err == "", err[-500:]
    assert logging.getLogger("torch.onnx").level == logging.WARNING  # restored


def test_lsq_export_warns_nothing_foreign(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
    x = torch.randn(4, 3, 12, 12)
    qmodel = qb.prepare_qat(model.eval(), "int8", [x], learn_scales=True).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qb.export(qmodel, tmp_path / "lsq.onnx", example_inputs=x)
    assert [str(w.message) for w in caught] == []


def test_our_warnings_point_at_the_users_line(cnn_q, tmp_path):
    qmodel = qb.quantize(cnn_q[0], [torch.randn(2, 3, 32, 32)], "int8_symmetric", progress=False)
    with pytest.warns(qb.onnx.PerformanceWarning) as caught:
        qb.export(qmodel, tmp_path / "s.onnx", example_inputs=torch.randn(2, 3, 32, 32))
    assert {w.filename for w in caught if w.category is qb.onnx.PerformanceWarning} == {__file__}
    recipe = qb.Recipe().with_rules(qb.Rule(pattern="no_such_layer.*", skip=True))
    with pytest.warns(UserWarning, match="matches no layer") as caught:
        qb.quantize(cnn_q[0], [torch.randn(2, 3, 32, 32)], recipe, progress=False)
    assert {w.filename for w in caught if "matches no layer" in str(w.message)} == {__file__}


# -- part 10 ---------------------------------------------------------------------------------------
def test_ppocr_models_are_found_without_the_shared_folder():
    folder = ppocr_dir()
    assert folder is not None, skip_reason()
    assert sorted(p.name for p in folder.glob("*.onnx")) == sorted(SHA256)


@pytest.mark.parametrize("umask, expected", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_save_writes_with_the_users_umask(tmp_path, umask, expected):
    qmodel = _linear_qmodel()
    old = os.umask(umask)
    try:
        qb.save(qmodel, tmp_path / "model.qb")
    finally:
        os.umask(old)
    assert oct((tmp_path / "model.qb").stat().st_mode & 0o777) == oct(expected)


def test_save_over_an_existing_file_keeps_its_permissions(tmp_path):
    path = tmp_path / "model.qb"
    path.write_bytes(b"")
    path.chmod(0o664)
    qb.save(_linear_qmodel(), path)
    assert oct(path.stat().st_mode & 0o777) == oct(0o664)


def test_readme_links_only_files_in_the_repository():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)\)", text) + re.findall(r"`(\.\./[^`]+)`", text)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links no local file"
    for target in local:
        path = (ROOT / target).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), f"README links {target}"


def test_test_extra_has_every_engine_the_tests_import():
    text = (ROOT / "pyproject.toml").read_text()  # no tomllib on Python 3.10
    block = re.search(r"^test = \[(.*?)^\]", text, re.M | re.S).group(1)
    names = set(re.findall(r'^\s*"([A-Za-z0-9_.-]+)', block, re.M))
    assert {"openvino", "pillow", "hypothesis", "scikit-learn"} <= names


def test_bench_help_describes_itself():
    out = subprocess.run(
        [sys.executable, "-m", "bench", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "quantbridge side by side with ONNX Runtime and PyTorch" in out
    assert not re.search(r"issue|#\d", out), out
