"""A model imported from ONNX keeps the file's input and output names through ``qb.quantize``
and ``qb.export`` (and in the one-line input errors).

``forward`` takes python identifiers (``input.1`` -> ``input_1``), and ``torch.export`` names
graph outputs after the last op: the exported file used to have inputs ``input_1``, ``extra_0``
and output ``add``, so code that fed the original file by name broke on the quantized one.
The file here is written by hand with names that are not identifiers (``input.1``, ``extra:0``),
one that is ``forward``'s own ``self`` (it used to fail at import: "duplicate argument 'self'"),
and an output named ``conv`` like a value inside the exported graph (renamed out of the way).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb
from quantbridge.recipe import native_preset

INPUTS = ["input.1", "extra:0", "self"]


def _file(path) -> str:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Conv", ["input.1", "w"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c", "extra:0"], ["a"], name="add1"),
        helper.make_node("Mul", ["a", "self"], ["conv"], name="mul1"),
    ]
    shape = ["N", 4, 8, 8]
    graph = helper.make_graph(
        nodes,
        "names",
        [helper.make_tensor_value_info("input.1", TensorProto.FLOAT, ["N", 3, 8, 8])]
        + [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in INPUTS[1:]],
        [helper.make_tensor_value_info("conv", TensorProto.FLOAT, shape)],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return str(path)


def test_quantized_export_keeps_the_files_names(tmp_path):
    module = qb.import_onnx(_file(tmp_path / "names.onnx"))
    assert module.qb_io_names["inputs"] == [
        ["input_1", "input.1"], ["extra_0", "extra:0"], ["self_2", "self"]
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 8, 8, generator=gen), *torch.randn(2, 2, 4, 8, 8, generator=gen))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-VNNI advice; not what this test is about
        qmodel = qb.quantize(module, [x], progress=False)
        model = qb.export(qmodel, tmp_path / "names.int8.onnx", example_inputs=x)
    assert [v.name for v in model.graph.input] == INPUTS
    assert [v.name for v in model.graph.output] == ["conv"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {n: t.numpy() for n, t in zip(INPUTS, x, strict=True)})
    # the same fake-quantized graph in ORT and torch; a float tie may round one activation
    # code the other way (DESIGN.md), which moves the output by at most one step times |self|
    steps = [float(q.current_scale().max()) for q in qmodel.quantizers().values()]
    bound = max(steps) * max(1.0, float(x[2].abs().max()))
    assert np.abs(got - qmodel(*x).detach().numpy()).max() <= bound
    with pytest.raises(ValueError, match=r"^input 'extra:0': expected shape \[batch, 4, 8, 8\]"):
        qmodel(x[0], torch.randn(2, 4, 8, 9), x[2])


def test_the_quantized_files_models_name_their_inputs_and_their_load(tmp_path):
    """Found by following the README as a newcomer: the QuantModel of an imported QDQ file had
    no input check (a wrong shape failed with torch's "Guard failed: extra_0.size()[1] == 4"),
    and ``qb.load`` without ``model=`` asked for "your float model class (model=MyModel())" for
    a model that came from an ONNX file."""
    module = qb.import_onnx(_file(tmp_path / "names.onnx"))
    x = (torch.randn(2, 3, 8, 8), torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-VNNI advice; not what this test is about
        qmodel = qb.quantize(module, [x], progress=False)
        qb.export(qmodel, tmp_path / "names.int8.onnx", example_inputs=x)
        imported = qb.import_onnx(tmp_path / "names.int8.onnx")
    with pytest.raises(ValueError, match=r"^input 'extra:0': .* the ONNX file declares it fixed"):
        imported(x[0], torch.randn(2, 4, 8, 9), x[2])
    qb.save(qmodel, tmp_path / "q.qb")
    with pytest.raises(TypeError, match=r"pass model=qb\.import_onnx\('<the \.onnx file"):
        qb.load(tmp_path / "q.qb")


class _TwoOutputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        return {"hidden": h, "logits": self.b(torch.relu(h))}


@pytest.mark.parametrize(
    ("model", "inputs", "outputs"),
    [
        # nn.Sequential's forward(input): torch.export says input_1, the last op quantize_dequantize_1
        (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4)), ["input"], ["output"]),
        (_TwoOutputs, ["x"], ["hidden", "logits"]),  # a dict: its keys
    ],
    ids=["sequential", "dict"],
)
def test_a_torch_models_export_is_named_as_its_user_knows_it(tmp_path, model, inputs, outputs):
    # session 13: a Sequential's file had input 'input_1' and output 'quantize_dequantize_1'
    x = torch.randn(2, 4)
    # native_preset: weights ONNX Runtime's int8 kernels compute exactly on this CPU (no VNNI:
    # 7-bit weights, else pair sums saturate; tests/onnx/test_saturation.py)
    qmodel = qb.quantize(model().eval(), [x], recipe=native_preset(), progress=False)
    path = tmp_path / "m.onnx"
    proto = qb.export(qmodel, path, example_inputs=x, progress=False, check=False)
    assert [v.name for v in proto.graph.input] == inputs
    assert [v.name for v in proto.graph.output] == outputs
    got = ort.InferenceSession(str(path)).run(None, {inputs[0]: x.numpy()})
    expected = qmodel(x)
    expected = list(expected.values()) if isinstance(expected, dict) else [expected]
    # the same values under the new names, in their order: ONNX Runtime and the fake quantization
    # round the same real numbers, so they differ by at most one output step (~0.01 here) at ties
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b.detach().numpy(), atol=0.03)
    fast = qb.to_engine(path, "onnxruntime")  # the engine calls it as the model: by forward's names
    assert type(fast(x)) is type(qmodel(x))
