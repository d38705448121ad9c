"""More first-hour mistakes and awkward-but-valid models (session 15 sweep), each through the call
a user makes: the result is right, or one quantbridge error that names the input, layer or
argument and the fix. Tiny models; each test well under two seconds.

Before each fix: a python number or flag given another value at call time, and a batch size that
``x.tolist()`` fixed, failed with torch's ``AssertionError: Guard failed: scale == 2.0``; a keyword
input the calibration never gave was torch's "unexpected keyword argument"; a forward writing its
input in place (``x.mul_(2)``) calibrated on x*2, x*4, x*8 and left the user's data multiplied by
8; a model of ``torch.ao`` quantized layers failed capture with "does not have a field with name
'__obj_flatten__'"; a path, a class or an ``ExportedProgram`` got "must be a torch.nn.Module";
``calib_data=5`` said "'int' object is not iterable" and ``max_batches=0`` "calibration data is
empty"; a class overriding ``__call__`` lost what it added, silently; tied weights were untied, so
QAT trained two copies; ``forward(self, batch)`` taking a dict or a list was refused; a float64
model's dtype fix said "pass float64 tensors (x.float()...)".
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantbridge as qb


def _data(n: int = 2, shape=(2, 4)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _quantize(model, data, **kw):
    return qb.quantize(model.eval(), data, progress=False, **kw)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale=1.0, flip=False):
        y = self.fc(x) * scale
        return -y if flip else y


def test_a_python_number_changed_at_call_names_the_input_not_a_guard():
    x = _data()
    qmodel = _quantize(Scaled(), [(t, 2.0) for t in x], recipe="int8")
    qmodel(x[0], 2.0)  # the captured value runs
    with pytest.raises(ValueError, match=r"input 'scale' is 5.0; the model was captured with 2.0"):
        qmodel(x[0], 5.0)


def test_a_keyword_the_calibration_never_gave_names_the_default_captured():
    x = _data()
    qmodel = _quantize(Scaled(), x, recipe="int8")
    torch.testing.assert_close(qmodel(x[0], flip=False), qmodel(x[0]), rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"input 'flip' .*default flip=False.*give flip"):
        qmodel(x[0], flip=True)


class ToList(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * len(x[:, 0].tolist())  # the batch size as a Python number


def test_a_size_the_model_made_a_python_number_names_the_input_and_the_cause():
    qmodel = _quantize(ToList(), _data(), recipe="int8")
    with pytest.raises(ValueError, match=r"input 'x': dimension 0 is 5.*needs 2.*x.tolist\(\)"):
        qmodel(torch.randn(5, 4))


class WritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.fc(x)


def test_a_forward_writing_its_input_is_refused_before_the_data_is_touched():
    data = _data()
    before = [t.clone() for t in data]
    with pytest.raises(qb.CaptureError, match=r"writes its input 'x' in place \(mul_\).*x.mul_\(2"):
        _quantize(WritesInput(), data)
    assert all(torch.equal(a, b) for a, b in zip(data, before, strict=True))


def test_torch_ao_quantized_layers_are_named_with_the_fix():
    converted = torch.ao.quantization.quantize_dynamic(
        nn.Sequential(nn.Linear(4, 4)), {nn.Linear}, dtype=torch.qint8
    )
    with pytest.raises(TypeError, match=r"layer '0' is a torch quantized module .*float model"):
        _quantize(converted, _data())


def test_what_is_not_a_module_instance_names_what_to_pass(tmp_path):
    program = torch.export.export(nn.Sequential(nn.Linear(4, 4)).eval(), (_data()[0],))
    cases = [
        (str(tmp_path / "model.pt"), r"model is a path .*load it first.*qb.import_onnx"),
        (nn.Linear, r"model is the class Linear; pass an instance: Linear\(\)"),
        (program, r"ExportedProgram; pass the nn.Module you exported.*\.module\(\)"),
    ]
    for model, expected in cases:
        with pytest.raises(TypeError, match=expected):
            qb.quantize(model, _data(), progress=False)


def test_an_exported_programs_module_quantizes_as_it_runs():
    x = _data(3)
    module = torch.export.export(nn.Sequential(nn.Linear(4, 4)).eval(), (x[0],)).module()
    qmodel = qb.quantize(module, x, recipe="int8", progress=False)  # its .eval() raises
    # int8 fake quant of a 4x4 linear: within a few output steps of the float model
    step = float(qmodel.output_quantizer().current_scale().max())
    assert float((qmodel(x[1]) - module(x[1])).abs().max()) <= 3 * step


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"calib_data": 5}, r"calib_data must be an iterable of batches .*got int"),
        ({"calib_data": "calib.npz"}, r"calib_data is a path \('calib.npz'\).*load them first"),
        ({"max_batches": 0}, r"max_batches=0: give a positive int"),
    ],
)
def test_calibration_arguments_of_the_wrong_kind_name_the_argument(kw, expected):
    args = {"calib_data": _data(), **kw}
    with pytest.raises((TypeError, ValueError), match=expected):
        qb.quantize(nn.Sequential(nn.Linear(4, 4)).eval(), progress=False, **args)


class CustomCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)

    def __call__(self, x):
        return super().__call__(x) * 3.0


def test_a_class_overriding_call_warns_that_only_forward_is_captured():
    with pytest.warns(UserWarning, match=r"CustomCall overrides __call__; .*forward only"):
        _quantize(CustomCall(), _data())


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_tied_weights_stay_one_parameter_through_quantize_and_qat():
    model = Tied().eval()
    ptq = _quantize(model, _data())
    assert ptq.a.weight is ptq.b.weight
    qat = qb.prepare_qat(model, "int8", _data(), progress=False)
    assert qat.a.weight is qat.b.weight and qat.a.weight is not model.a.weight
    qat.train()
    qat(_data()[0]).square().sum().backward()
    torch.optim.SGD(qat.parameters(), lr=0.1).step()
    assert torch.equal(qat.a.weight, qat.b.weight)  # trained as one tensor
    assert not torch.equal(qat.a.weight, model.a.weight)  # the user's model untouched


class DictInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, batch):
        return self.fc(batch["x"]) + batch["extra"][0]


def test_a_forward_taking_a_dict_of_a_list_quantizes_saves_and_loads(tmp_path):
    x = _data(3)
    batches = [({"x": t, "extra": [t * 2]},) for t in x]
    model = DictInput().eval()
    qmodel = _quantize(model, batches, recipe="int8")
    call = {"x": torch.randn(5, 4), "extra": [torch.randn(5, 4)]}
    # uint8 activations over ~[-8, 8] and int8 weights: the output within a few of its steps
    step = float(qmodel.output_quantizer().current_scale().max())
    assert float((qmodel(call) - model(call)).abs().max()) <= 4 * step
    qb.save(qmodel, tmp_path / "m.qb")
    loaded = qb.load(tmp_path / "m.qb", DictInput())
    torch.testing.assert_close(loaded(call), qmodel(call), rtol=0, atol=0)


def test_a_float64_model_is_told_to_cast_to_float64():
    model = nn.Sequential(nn.Linear(4, 4)).double()
    with pytest.raises(ValueError, match=r"pass float64 tensors \(x.to\(torch.float64\)"):
        _quantize(model, _data())


# -- export and compare ------------------------------------------------------------------------
def test_export_and_compare_name_a_missing_input_and_an_unknown_opset(tmp_path):
    x = _data()
    qmodel = _quantize(nn.Sequential(nn.Linear(4, 4)), x, recipe="int8")
    # session 15: 'calibration batch 0 is a NoneType' / numpy's object-array message / the onnx
    # checker's "Unrecognized attribute: output_dtype for operator DequantizeLinear"
    with pytest.raises(TypeError, match=r"^example_inputs is a NoneType; .*example_inputs=x"):
        qb.export(qmodel, tmp_path / "m.onnx", None, progress=False)
    with pytest.raises(TypeError, match=r"inputs is None: pass the inputs to run"):
        qb.compare(qmodel, inputs=None)
    with pytest.raises(ValueError, match=r"opset 99: the installed onnx .* knows opsets up to"):
        qb.export(qmodel, tmp_path / "m.onnx", x[0], opset=99, progress=False)
    assert not (tmp_path / "m.onnx").exists()


# ---- session 16: the three mistakes session 15's sweep noticed and left ------------------------


def test_export_of_a_list_of_batches_says_example_inputs_is_one_batch(tmp_path):
    """Before: "bad call of forward(input): too many positional arguments", no hint that
    ``example_inputs`` takes one batch (users pass their calibration list)."""
    data = _data()
    q = _quantize(nn.Sequential(nn.Linear(4, 4)), data)
    with pytest.raises(
        TypeError, match=r"a list of 2 is read as 2 positional inputs.*batches\[0\]"
    ):
        qb.export(q, tmp_path / "m.onnx", data)
    assert not (tmp_path / "m.onnx").exists()
    qb.export(q, tmp_path / "m.onnx", data[0], progress=False)  # one batch: written
    assert (tmp_path / "m.onnx").stat().st_size > 0


@pytest.mark.parametrize("name", ["m.pt", "m.PTH", "m.ckpt"])
def test_export_to_a_torch_checkpoint_name_points_to_save(tmp_path, name):
    """Before: ``qb.export(q, "m.pt", x)`` wrote an ONNX file named .pt and said nothing; then
    ``qb.load("m.pt")`` or ``torch.load`` failed far from the mistake."""
    data = _data()
    q = _quantize(nn.Sequential(nn.Linear(4, 4)), data)
    with pytest.raises(ValueError, match=r"export writes an ONNX file.*name it \.onnx.*qb\.save"):
        qb.export(q, tmp_path / name, data[0])
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize(
    "engine, fix",
    [("tensorrt", r"engine='onnxruntime', providers=\['TensorrtExecutionProvider'"),
     ("TRT", r"TensorRT runs through ONNX Runtime"),
     ("cuda", r"CUDA is a device: engine='onnxruntime', device='cuda'")],
)  # fmt: skip
def test_to_engine_names_the_engine_a_backend_runs_through(engine, fix):
    """Before: ``to_engine(q, "tensorrt")`` said "unknown engine; known engines: onnxruntime,
    openvino" while ``compare`` lists tensorrt (through ORT's TensorRT provider)."""
    data = _data()
    q = _quantize(nn.Sequential(nn.Linear(4, 4)), data)
    with pytest.raises(ValueError, match=fix):
        qb.to_engine(q, engine, example_inputs=data[0])
