"""Issue 13, the first hour of a new user: each test is a call as a user makes it, asserting on the
one-line message or the result they get.

Parts 1-2 (calibration data and shapes as users pass them): a batch that does not fit ``forward``,
a wrong size, rank or dtype at call time, at export or in calibration is one line naming the input,
the expected and received shape and the ``dynamic=`` option; float64 data is cast, said once.

Part 3 (export keeps what quantize captured): ``dynamic="all"`` at quantize means dynamic height and
width in the file, named ``batch``, ``height``, ``width``.

Part 5 (w4a8 means 4-bit in the file): INT4 initializers at opset 21, the scheme named W4A8.

Part 6 (import_onnx errors): a file that is not ONNX is a ValueError naming the file; a shape
error at run time names the ONNX node, as ONNX Runtime does.

Part 7 (progress): capture, calibration and export each report one line on stderr (not a
terminal here); ``progress=False`` and ``qb.set_progress(False)`` turn it off.

Part 8 (quiet by default): ``qb.export`` from Python prints nothing of torch's, LSQ export warns
nothing foreign, and our own warnings point at the user's line.

Part 9 (inspect at a glance): a summary by default, each weight under ``--verbose``, the producer
named ``quantbridge <version>``.

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
from quantbridge.cli import main
from quantbridge.zoo import DigitsCNN

ROOT = Path(__file__).resolve().parents[1]


def _linear_qmodel() -> qb.QuantModel:
    return qb.quantize(
        nn.Sequential(nn.Linear(4, 4)).eval(), [torch.randn(2, 4)], progress=False, recipe="int8"
    )


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
    return model, qb.quantize(
        model, [torch.randn(4, 3, 32, 32) for _ in range(2)], progress=False, recipe="int8"
    )


# -- part 1 ------------------------------------------------------------------------------------------
def test_dataloader_of_inputs_and_labels_names_the_transform():
    loader = DataLoader(TensorDataset(torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16,))), 4)
    with pytest.raises(TypeError) as info:
        qb.quantize(SmallCNN().eval(), loader, progress=False, recipe="int8")
    message = str(info.value)
    assert message.startswith(
        "calibration batch 0 (float32[4, 3, 32, 32], int64[4]) does not fit SmallCNN.forward(x): "
        "too many positional arguments."
    )
    assert "pass transform=lambda b: b[0]" in message
    assert "torch.export" not in message and ".item()" not in message  # no capture advice
    qmodel = qb.quantize(
        SmallCNN().eval(), loader, transform=lambda b: b[0], progress=False, recipe="int8"
    )
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
        qb.quantize(SmallCNN().eval(), data, progress=False, recipe="int8")
    assert str(info.value) == f"calibration batch 1: {WRONG_SIZE}"
    assert "s7" not in str(info.value) and "Guard" not in str(info.value)


def test_wrong_rank_and_dtype_at_call_time(cnn_q):
    qmodel = qb.quantize(
        cnn_q[0], [torch.randn(4, 3, 32, 32)], progress=False, dynamic="all", recipe="int8"
    )
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
    qmodel = qb.quantize(
        cnn_q[0], [torch.randn(4, 3, 32, 32)], progress=False, dynamic="none", recipe="int8"
    )
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
        qmodel = qb.quantize(cnn_q[0], data, progress=False, recipe="int8")
    ours = [w for w in caught if "casting the batches" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__  # points at the quantize call
    x = data[0].float()
    reference = qb.quantize(cnn_q[0], [d.float() for d in data], progress=False, recipe="int8")
    torch.testing.assert_close(qmodel(x), reference(x), rtol=0, atol=0)  # same scales, same ints


# -- part 3 ------------------------------------------------------------------------------------------
class Segmenter(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        return torch.sigmoid(self.head(torch.relu(self.conv(x))))


def _dims(values) -> dict[str, list]:
    return {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values
    }


def test_export_keeps_the_dynamic_image_size_quantize_captured(tmp_path):
    torch.manual_seed(0)
    calib = [torch.randn(2, 3, 32, 32) for _ in range(2)]
    qmodel = qb.quantize(Segmenter().eval(), calib, dynamic="all", progress=False, recipe="int8")
    proto = qb.export(qmodel, tmp_path / "seg.onnx", example_inputs=calib[0])  # no dynamic=
    assert _dims(proto.graph.input) == {"x": ["batch", 3, "height", "width"]}
    assert _dims(proto.graph.output) == {
        "output": ["batch", 1, "height", "width"]
    }  # forward returns one tensor
    x = torch.randn(1, 3, 48, 40)  # another image size than calibration's
    options = ort.SessionOptions()  # node by node: the same arithmetic as torch's fake quant
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    (y,) = ort.InferenceSession(tmp_path / "seg.onnx", options).run(None, {"x": x.numpy()})
    assert y.shape == (1, 1, 48, 40)
    step = list(qmodel.quantizers().values())[-1].scale.item()
    with torch.no_grad():
        assert np.abs(y - qmodel(x).numpy()).max() / step <= 1.001  # float ties: at most 1 LSB


def test_export_of_a_batch_only_capture_stays_fixed_size(tmp_path):
    qmodel = qb.quantize(
        Segmenter().eval(), [torch.randn(2, 3, 32, 32)], progress=False, recipe="int8"
    )
    proto = qb.export(qmodel, tmp_path / "seg.onnx", example_inputs=torch.randn(2, 3, 32, 32))
    assert _dims(proto.graph.input) == {"x": ["batch", 3, 32, 32]}


# -- part 5 ------------------------------------------------------------------------------------------
def _weight_bytes(model: onnx.ModelProto) -> int:
    return sum(len(i.raw_data) for i in model.graph.initializer if i.name.endswith("qweight"))


def test_w4a8_file_holds_int4_weights_and_names_the_scheme(tmp_path):
    torch.manual_seed(0)
    model, x = DigitsCNN().eval(), torch.rand(16, 1, 8, 8)
    w4 = qb.quantize(model, [x], "w4a8", progress=False)
    with pytest.warns(qb.onnx.PerformanceWarning, match="INT4 weights: ONNX Runtime"):
        proto = qb.export(w4, tmp_path / "w4.onnx", example_inputs=x)
    assert proto.opset_import[0].version == 21
    weights = [i for i in proto.graph.initializer if i.name.endswith("export_qweight")]
    assert {i.data_type for i in weights} == {TensorProto.INT4}
    n_codes = sum(int(np.prod(i.dims)) for i in weights)
    assert _weight_bytes(proto) == sum((int(np.prod(i.dims)) + 1) // 2 for i in weights)
    w8 = qb.export(qb.quantize(model, [x], "int8", progress=False), tmp_path / "w8.onnx", x)
    assert _weight_bytes(w8) == n_codes  # one byte per code: the 4-bit file holds half
    # measured: 47479 vs 70197 bytes (scales, biases and graph are the same in both)
    assert (tmp_path / "w4.onnx").stat().st_size < 0.7 * (tmp_path / "w8.onnx").stat().st_size
    y4 = ort.InferenceSession(tmp_path / "w4.onnx").run(None, {"x": x.numpy()})[0]
    qb.export(w4, tmp_path / "w4_18.onnx", example_inputs=x, opset=18)  # int8 container
    y18 = ort.InferenceSession(tmp_path / "w4_18.onnx").run(None, {"x": x.numpy()})[0]
    np.testing.assert_array_equal(y4, y18)  # same codes, same engine arithmetic
    report = qb.onnx.inspect_model(tmp_path / "w4.onnx")
    assert report.scheme == "W4A8" and "form:      QDQ, scheme W4A8" in report.format()


# -- part 6 ------------------------------------------------------------------------------------------
def test_import_of_a_file_that_is_not_onnx_names_the_file(tmp_path):
    path = tmp_path / "README.onnx"
    path.write_text("# not a model\n")
    with pytest.raises(ValueError) as info:
        qb.import_onnx(path)
    assert str(info.value).startswith(f"import_onnx: {str(path)!r} is not a readable ONNX model (")


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


# -- part 7 ------------------------------------------------------------------------------------------
def test_each_long_step_reports_one_line_on_stderr(tmp_path, capfd):
    calib = [torch.randn(4, 3, 32, 32) for _ in range(3)]
    capfd.readouterr()
    qmodel = qb.quantize(SmallCNN().eval(), calib, recipe="int8")
    qb.export(qmodel, tmp_path / "m.onnx", example_inputs=calib[0])
    out, err = capfd.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 3, err
    assert re.fullmatch(
        r"quantbridge: capturing SmallCNN \(torch.export, dynamic='batch'\) \.\.\. \d+\.\d s",
        lines[0],
    )
    assert re.fullmatch(r"quantbridge: calibrating on 3 batches \.\.\. \d+\.\d s", lines[1])
    assert re.fullmatch(
        r"quantbridge: exporting to ONNX \(opset 18, dynamic='batch'\) \.\.\. \d+\.\d s",
        lines[2],
    )


def test_progress_switches_off(tmp_path, capfd):
    calib = [torch.randn(4, 3, 32, 32)]
    capfd.readouterr()
    qb.quantize(SmallCNN().eval(), calib, progress=False, recipe="int8")
    assert capfd.readouterr().err == ""
    qb.set_progress(False)
    try:
        qmodel = qb.quantize(SmallCNN().eval(), calib, recipe="int8")
        qb.export(qmodel, tmp_path / "m.onnx", example_inputs=calib[0])
    finally:
        qb.set_progress(True)
    assert capfd.readouterr().err == ""
    with pytest.raises(TypeError, match="takes True or False"):
        qb.set_progress("no")


# -- part 8 ------------------------------------------------------------------------------------------
def test_python_export_prints_nothing(cnn_q, tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(logging.getLogger("torch.onnx"), "level", logging.WARNING)  # as for users
    capfd.readouterr()
    qb.export(cnn_q[1], tmp_path / "m.onnx", example_inputs=torch.randn(2, 3, 32, 32))
    out, err = capfd.readouterr()
    assert out == "" and "torchvision" not in err, err[-500:]
    assert all(line.startswith("quantbridge: exporting") for line in err.splitlines()), err
    assert logging.getLogger("torch.onnx").level == logging.WARNING  # restored


def test_lsq_export_warns_nothing_foreign(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
    x = torch.randn(4, 3, 12, 12)
    qmodel = qb.prepare_qat(model.eval(), "int8", [x], learn_scales=True).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qb.export(qmodel, tmp_path / "lsq.onnx", example_inputs=x)
    ours = (qb.onnx.PerformanceWarning, qb.onnx.SaturationWarning)  # this CPU's, not foreign
    assert [str(w.message) for w in caught if not issubclass(w.category, ours)] == []


def test_our_warnings_point_at_the_users_line(cnn_q, tmp_path):
    qmodel = qb.quantize(cnn_q[0], [torch.randn(2, 3, 32, 32)], "w4a8", progress=False)
    with pytest.warns(qb.onnx.PerformanceWarning) as caught:  # INT4 weights run in float in ORT
        qb.export(qmodel, tmp_path / "s.onnx", example_inputs=torch.randn(2, 3, 32, 32))
    assert {w.filename for w in caught if w.category is qb.onnx.PerformanceWarning} == {__file__}
    recipe = qb.Recipe().with_rules(qb.Rule(pattern="no_such_layer.*", skip=True))
    with pytest.warns(UserWarning, match="matches no layer") as caught:
        qb.quantize(cnn_q[0], [torch.randn(2, 3, 32, 32)], recipe, progress=False)
    assert {w.filename for w in caught if "matches no layer" in str(w.message)} == {__file__}


# -- part 9 ------------------------------------------------------------------------------------------
def test_inspect_shows_a_summary_and_lists_weights_under_verbose(cnn_q, tmp_path, capsys):
    path = tmp_path / "m.onnx"
    qb.export(cnn_q[1], path, example_inputs=torch.randn(2, 3, 32, 32))
    capsys.readouterr()
    assert main(["inspect", str(path)]) == 0
    short = capsys.readouterr().out
    assert main(["inspect", str(path), "--verbose"]) == 0
    long = capsys.readouterr().out
    assert f"producer:  quantbridge {qb.__version__}; IR version" in short
    assert "form:      QDQ, scheme W8A8" in short
    summary = (
        "weights:   2 (2 x int8 8-bit per-channel(axis=0); biases 2 x int32; --verbose lists each)"
    )
    assert summary in short.splitlines()
    assert "export_qweight" not in short
    weight_lines = [line for line in long.splitlines() if "export_qweight (" in line]
    assert len(weight_lines) == 2 and len(long.splitlines()) == len(short.splitlines()) + 2


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
