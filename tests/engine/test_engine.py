"""``qb.to_engine`` with ONNX Runtime (issue 15 parts 1-4): the engine model is called like the
user's model and returns what a hand-made ONNX Runtime session on the exported file returns,
bit for bit, in the user's output structure.

The models are small (a conv + linear with a keyword input and nested outputs, and the zoo's
DigitsCNN) and run on one engine thread, so a test file takes seconds.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.engine import TRAIN_MESSAGE, EngineModel


class Nested(nn.Module):
    """Two inputs (one optional keyword), a plain-value input and a dict-of-tuple output."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x, mask=None, scale: float = 1.0):
        h = self.conv(x).relu().mean((2, 3))
        logits = self.head(h) * scale
        return {"logits": logits, "pair": (h, logits * mask)}


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 12, 12, generator=g), torch.rand(4, 5, generator=g)


@pytest.fixture(scope="module")
def qmodel(data):
    x, mask = data
    torch.manual_seed(0)
    return qb.quantize(Nested().eval(), [{"x": x, "mask": mask}], recipe="int8")


@pytest.fixture(scope="module")
def fast(qmodel, data):
    x, mask = data
    return qb.to_engine(qmodel, "onnxruntime", example_inputs={"x": x, "mask": mask}, threads=1)


def _hand_session(model: onnx.ModelProto, path) -> ort.InferenceSession:
    """What a user writes by hand: the file on disk, one thread, ORT's default optimizations."""
    onnx.save_model(model, str(path))
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def test_outputs_are_bit_identical_to_a_hand_made_session(fast, data, tmp_path):
    x, mask = data
    out = fast(x, mask=mask)
    session = _hand_session(fast.onnx_model, tmp_path / "m.onnx")
    names = [o.name for o in session.get_outputs()]
    ref = dict(zip(names, session.run(None, {"x": x.numpy(), "mask": mask.numpy()}), strict=True))
    assert set(out) == {"logits", "pair"} and isinstance(out["pair"], tuple)
    flat = [out["logits"], out["pair"][0], out["pair"][1]]
    assert len(flat) == len(names)
    # exact: the same graph, bytes and options in both sessions (0 LSB, 0 ulp)
    for got, want in zip(flat, (ref[n] for n in names), strict=True):
        assert isinstance(got, torch.Tensor) and not got.requires_grad
        np.testing.assert_array_equal(got.numpy(), want)


def test_the_quantized_form_is_a_qdq_graph(fast):
    ops = {n.op_type for n in fast.onnx_model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops and fast.precision == "int8"


def test_positional_keyword_and_mixed_calls_agree(fast, data):
    x, mask = data
    a = fast(x, mask)["logits"]
    b = fast(mask=mask, x=x)["logits"]
    assert torch.equal(a, b)


def test_dynamic_batch_follows_the_capture(fast, data):
    x, mask = data
    whole = fast(x, mask)["logits"]
    for n in (1, 3, 7):
        xs, ms = x.repeat(2, 1, 1, 1)[:n], mask.repeat(2, 1)[:n]
        out = fast(xs, ms)["logits"]
        assert out.shape == (n, 5)
    np.testing.assert_array_equal(fast(x[:1], mask[:1])["logits"].numpy()[0], whole.numpy()[0])


def test_float_mode_and_set_quantization_run_the_fp32_export_of_the_same_weights(
    fast, qmodel, data
):
    x, mask = data
    int8 = fast(x, mask)["logits"]
    with qb.float_mode(qmodel):
        float_ref = qmodel(x, mask)["logits"].detach()
    with qb.float_mode(fast):
        assert fast.precision == "fp32"
        ops = {n.op_type for n in fast.onnx_model.graph.node}
        assert not ops & {"QuantizeLinear", "DequantizeLinear"}
        got = fast(x, mask)["logits"]
    assert fast.precision == "int8"
    # fp32 graph vs torch fp32: different summation order only (float32 ulps, not LSBs)
    torch.testing.assert_close(got, float_ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, int8)
    fast.set_quantization(False)
    try:
        assert torch.equal(fast(x, mask)["logits"], got)  # the same, kept session
        assert len(fast._sessions) == 2
    finally:
        fast.set_quantization(True)
    assert torch.equal(fast(x, mask)["logits"], int8)


def test_the_float_form_is_the_snapshot_taken_at_to_engine(qmodel, data):
    x, mask = data
    fast = qb.to_engine(qmodel, "onnxruntime", example_inputs=(x, mask), threads=1)
    weight = qmodel.get_parameter("head.weight")
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.add_(1.0)  # "training" after to_engine does not reach the engine model
        with qb.float_mode(fast):
            got = fast(x, mask)["logits"]
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    with qb.float_mode(qmodel):
        want = qmodel(x, mask)["logits"].detach()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda f, x, m: f(x), "missing input 'mask'"),
        (lambda f, x, m: f(x, m, m, m), "too many positional arguments"),
        (lambda f, x, m: f(x, m, bias=m), "unexpected keyword argument 'bias'"),
        # captured without scale: its default (1.0) is accepted, another value refused naming it
        (lambda f, x, m: f(x, m, scale=2.0), "input 'scale' (forward(x, mask, scale)) was not"),
        (lambda f, x, m: f(x.double(), m), "input 'x' is float64[4, 3, 12, 12]; expected float32"),
        # regressions: numpy has no bfloat16 and a meta tensor no data; torch's errors leaked
        (lambda f, x, m: f(x.bfloat16(), m), "input 'x' is bfloat16[4, 3, 12, 12]; expected"),
        (lambda f, x, m: f(x, m.to("meta")), "input 'mask' is on the meta device (no data)"),
        (lambda f, x, m: f(x[:, :2], m), "input 'x' has shape [4, 2, 12, 12]; expected"),
        (lambda f, x, m: f(x[0], m), "input 'x' has shape [3, 12, 12]"),
        # regression: a sequence length / image size fixed by the export had no fix in the message
        (
            lambda f, x, m: f(torch.nn.functional.pad(x, (0, 4, 0, 4)), m),
            "[4, 3, 16, 16]; expected float32[batch, 3, 12, 12] (the export fixed dimension 2 "
            "at 12: quantize with dynamic='all' and make the engine model again",
        ),
        (lambda f, x, m: f(x, m.numpy()), "input 'mask' is a ndarray; expected a torch.Tensor"),
    ],
)
def test_bad_calls_get_one_line_errors_naming_the_signature(fast, data, call, message):
    x, mask = data
    with pytest.raises((TypeError, ValueError)) as info:
        call(fast, x, mask)
    text = str(info.value)
    assert message in text
    assert "\n" not in text
    assert text.endswith(
        "this engine model is called as forward(x: float32[batch, 3, 12, 12], "
        "mask: float32[batch, 5])"
    )


def test_plain_values_are_constants_of_the_graph(data):
    x, mask = data
    model = Nested().eval()
    fast = qb.to_engine(model, "ort", example_inputs=(x, mask, 2.0), threads=1)
    torch.testing.assert_close(fast(x, mask, 2.0)["logits"], model(x, mask, 2.0)["logits"])
    with pytest.raises(ValueError, match=r"got 3\.0 where the export baked in 2\.0"):
        fast(x, mask, 3.0)


def test_a_quantmodels_plain_values_are_constants_too(data):
    # GPT-2 / Llama are called with use_cache=False: the one-trace export once made such a value
    # an int64 graph input, and every call was refused ("input 'use_cache' is a bool")
    x, mask = data
    torch.manual_seed(0)
    qmodel = qb.quantize(Nested().eval(), [{"x": x, "mask": mask, "scale": 2.0}], progress=False)
    fast = qb.to_engine(qmodel, "ort", threads=1)
    assert fast.signature.endswith("mask: float32[batch, 5], scale: 2.0)")
    got, want = fast(x, mask, scale=2.0)["logits"], qmodel(x, mask, scale=2.0)["logits"]
    # the default preset's logits are float: ORT's fused kernels vs torch's fake quantization
    # differ by float summation order only (values are O(1))
    torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"got 3\.0 where the export baked in 2\.0"):
        fast(x, mask, scale=3.0)
    with pytest.raises(TypeError, match=r"'scale' \(the export baked in scale=2\.0: pass that"):
        fast(x, mask)


def test_a_float_torch_model_runs_its_fp32_export(data):
    x, mask = data
    model = Nested().eval()
    fast = qb.to_engine(model, "onnxruntime", example_inputs=(x, mask), threads=1)
    assert fast.forms == ["fp32"] and fast.precision == "fp32"
    # fp32 in both: summation order only
    torch.testing.assert_close(fast(x, mask)["logits"], model(x, mask)["logits"].detach())
    with pytest.raises(TypeError, match="input 'scale' was not part of the exported call"):
        fast(x, mask, scale=2.0)  # the user's forward has it; the export did not take it
    with pytest.raises(ValueError, match="no quantized form; quantize it first"):
        fast.set_quantization(True)
    with qb.float_mode(fast):  # a no-op switch for a float model
        assert fast.precision == "fp32"


class _WithKwargs(torch.nn.Module):
    """A forward that ends in ``**kwargs``, as Hugging Face models' do."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x, scale=None, **kwargs):
        return self.fc(x)


def test_a_float_model_whose_forward_takes_kwargs_runs_behind_an_engine():
    # regression: the recorded signature gave **kwargs a default, which Python refuses
    # ("variadic keyword parameters cannot have default values"; a float HF BertModel)
    model = _WithKwargs().eval()
    x = torch.randn(2, 8)
    fast = qb.to_engine(model, "onnxruntime", example_inputs=(x,), threads=1)
    # fp32 in both: summation order only
    torch.testing.assert_close(fast(x), model(x).detach(), rtol=1e-5, atol=1e-5)


def test_an_onnx_file_is_called_by_its_recorded_signature(fast, data, tmp_path):
    x, mask = data
    path = tmp_path / "m.int8.onnx"
    fast.save_onnx(path)
    again = qb.to_engine(path, "onnxruntime", threads=1)
    assert again.forms == ["int8"]
    assert torch.equal(again(x, mask=mask)["pair"][1], fast(x, mask)["pair"][1])
    with pytest.raises(ValueError, match="has no float form"):
        again.set_quantization(False)


def test_a_foreign_onnx_file_is_called_by_its_input_names(tmp_path):
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Add", ["a", "b"], ["s"]),
            onnx.helper.make_node("Neg", ["a"], ["n"]),
        ],
        "g",
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["N", 2]) for n in "ab"],
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["N", 2]) for n in "sn"],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    fast = qb.to_engine(model, "onnxruntime", threads=1)
    a, b = torch.randn(3, 2), torch.randn(3, 2)
    s, n = fast(a, b=b)
    assert torch.equal(s, a + b) and torch.equal(n, -a)
    with pytest.raises(TypeError, match=r"missing input 'b'; .* forward\(a: float32\[N, 2\]"):
        fast(a)


def test_train_raises_and_eval_and_no_grad_are_implied(fast, data):
    x, mask = data
    assert not fast.training
    with pytest.raises(RuntimeError, match=TRAIN_MESSAGE):
        fast.train()
    assert fast.eval() is fast and list(fast.parameters()) == []
    out = fast(x.requires_grad_(True), mask)["logits"]
    assert not out.requires_grad
    x.requires_grad_(False)


def test_repr_shows_engine_precision_signature_and_file_size(fast):
    text = repr(fast)
    assert text.startswith("EngineModel(engine=onnxruntime, precision=int8, forward(x: float32")
    assert f"file={len(fast.onnx_bytes()) / 1024:.1f} KB" in text and "forms=int8/fp32" in text


def test_to_engine_input_errors(qmodel, data):
    x, _ = data
    with pytest.raises(ValueError, match="unknown engine 'tvm'; known engines: onnxruntime"):
        qb.to_engine(qmodel, "tvm")
    with pytest.raises(TypeError, match="has no option 'devise'; its options are device"):
        qb.to_engine(qmodel, "onnxruntime", devise="cpu")
    with pytest.raises(TypeError, match="needs example_inputs= for a Nested"):
        qb.to_engine(Nested(), "onnxruntime")
    with pytest.raises(TypeError, match="takes a QuantModel, a torch model or an ONNX file"):
        qb.to_engine(42, "onnxruntime")
    with pytest.raises(FileNotFoundError, match="no ONNX file at"):
        qb.to_engine("/nonexistent/m.onnx", "onnxruntime")


def test_example_inputs_default_to_the_capture(qmodel, data):
    x, mask = data
    fast = qb.to_engine(qmodel, "onnxruntime", threads=1)
    assert isinstance(fast, EngineModel)
    assert fast(x, mask)["logits"].shape == (4, 5)


class TupleInput(nn.Module):
    def forward(self, x, pair):
        a, b = pair
        return [x * a, b - x]


def test_nested_inputs_and_a_list_output(tmp_path):
    x, a, b = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    fast = qb.to_engine(TupleInput(), "onnxruntime", example_inputs=(x, (a, b)), threads=1)
    assert fast.signature == (
        "forward(x: float32[batch, 4], pair: (float32[batch, 4], float32[batch, 4]))"
    )
    out = fast(x, pair=(a, b))
    assert isinstance(out, list) and torch.equal(out[0], x * a) and torch.equal(out[1], b - x)
    with pytest.raises(ValueError, match=r"structure \(\(float32\[3, 4\], \(float32\[3, 4\],\)\)"):
        fast(x, (a,))


def test_all_dynamic_dims_follow_the_quantmodels_capture(data):
    x, mask = data
    qmodel = qb.quantize(Nested().eval(), [(x, mask)], dynamic="all", recipe="int8")
    fast = qb.to_engine(qmodel, "onnxruntime", example_inputs=(x, mask), threads=1)
    assert "float32[batch, " in fast.signature and ", 12, 12]" not in fast.signature
    bigger = torch.randn(2, 3, 20, 16)  # another image size: only "all" accepts it
    assert fast(bigger, mask[:2])["logits"].shape == (2, 5)


def test_dynamic_all_from_a_batch_capture_is_refused_with_the_fix(qmodel):
    # regression: the export silently kept every non-batch size fixed
    with pytest.raises(ValueError, match="quantized with dynamic='batch'.*quantize with dynamic="):
        qb.to_engine(qmodel, "onnxruntime", dynamic="all")


def test_export_dynamic_all_from_a_batch_capture_is_refused_with_the_fix(qmodel, data, tmp_path):
    # regression: qb.export wrote a file with every non-batch size fixed, without a word
    x, mask = data
    with pytest.raises(ValueError, match=r"export\(dynamic='all'\): .*dynamic='batch'.*quantize"):
        qb.export(qmodel, tmp_path / "m.onnx", {"x": x, "mask": mask}, dynamic="all")
    assert not (tmp_path / "m.onnx").exists()


def test_an_engine_that_is_not_installed_names_the_pip_extra(monkeypatch):
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["a"], ["r"])],
        "g",
        [onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["N"])],
        [onnx.helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, ["N"])],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    monkeypatch.setitem(sys.modules, "openvino", None)  # what Python does for a missing package
    with pytest.raises(
        ImportError, match=r"needs the openvino package: pip install 'quantbridge\[openvino\]'"
    ):
        qb.to_engine(model, "openvino")
