"""Issue 10: ``torch.nn.TransformerEncoder`` (SDPA attention) quantized by quantbridge lowers to an
integer-only program, the three emitters agree bit for bit, the program stays close to ONNX
Runtime running the QDQ model, and ``integer_mode`` computes the program's numbers.

``nn.TransformerEncoderLayer`` calls ``nn.MultiheadAttention`` with ``need_weights=False``, so
torch runs ``F.scaled_dot_product_attention``; capture rewrites it as eager attention
(``torch/_sdpa.py``): ``(q @ k^T) * scale -> softmax -> @ v``. The scores ``q @ k^T`` feed the
scale ``Mul``, so placement quantizes them (int8, ORT QLinearMatMul) and the lowered Softmax
reads 8-bit codes: nothing in the QDQ model changes for the integer program. What the
encoder adds over ``zoo.EncoderStack`` (``test_integer_transformer``): its graph output is its
last LayerNorm, computed in float after the last quantized tensor; ``lower(...,
float_outputs="dequantize")`` realizes it on an int16 grid of its range inside the program and
dequantizes outside it (``lowering._outputs``), ``float_outputs="refuse"`` refuses it.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.integer import LoweringError
from quantbridge.integer._npz import load_npz, save_npz

SHAPE = (2, 8, 32)  # batch, tokens, width (4 heads of 8)


def encoder_model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("torch_encoder") / "encoder.onnx"
    torch.manual_seed(1)
    data = [torch.randn(*SHAPE) for _ in range(4)]
    qmodel = qb.quantize(encoder_model(), data, recipe="int8", progress=False)
    with warnings.catch_warnings():  # without VNNI: the engine-saturation warning (ORT runs
        warnings.simplefilter("ignore")  # node by node here, exact with any weights)
        qb.export(qmodel, path, example_inputs=torch.zeros(*SHAPE))
    return qmodel, onnx.load(path), qb.lower(path, float_outputs="dequantize")


def _inputs(seed: int, batch: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, *SHAPE[1:])).astype(np.float32)


def test_encoder_lowers_with_int8_scores_and_integer_softmax(encoder):
    _, model, prog = encoder
    producer = {o: n for n in model.graph.node for o in n.output}
    for softmax in (n for n in model.graph.node if n.op_type == "Softmax"):
        chain, name = [], softmax.input[0]
        for _ in range(3):
            chain.append(producer[name].op_type)
            name = producer[name].input[0]
        assert chain == ["Mul", "DequantizeLinear", "QuantizeLinear"]  # int8 scores, then scale
        assert producer[name].op_type == "MatMul"
    norms = [s for s in prog.steps if s.op == "layernorm"]
    assert prog.op_counts()["softmax"] == 2
    # every LayerNormalization of the file, the last one (the graph output) on int16 codes; a
    # layer norm read by two QuantizeLinear (directly and through a Transpose) runs twice
    assert len({s.node for s in norms}) == 4 and norms[-1].output == prog.outputs[0].tensor.name
    assert all(np.dtype(t.dtype).kind in "iu" for t in prog.tensors.values())
    (out,) = prog.outputs
    assert out.is_float and out.tensor.dtype == np.int16 and out.table is None


def test_final_layer_norm_is_refused_on_request(encoder, tmp_path):
    _, model, _ = encoder
    with pytest.raises(LoweringError, match="float_outputs='dequantize'.*layer norm"):
        qb.lower(model, float_outputs="refuse")


def test_three_emitters_identical_on_the_encoder(encoder, three_emitters, tmp_path):
    _, _, prog = encoder
    x = _inputs(1, batch=2) * 3  # beyond the calibrated range too: saturation paths
    three_emitters(prog, {"src": x}, tmp_path)
    save_npz(prog, tmp_path / "prog.npz")  # the int16 float-output boundary survives the file
    again = load_npz(tmp_path / "prog.npz")
    assert again.outputs == prog.outputs
    np.testing.assert_array_equal(again.run({"src": x})[again.outputs[0].name],
                                  prog.run({"src": x})[prog.outputs[0].name])  # fmt: skip


def _ort_from_program_codes(model: onnx.ModelProto, prog, x: np.ndarray, session) -> np.ndarray:
    """ORT (node by node) computing the graph output from the program's own codes at every
    activation QuantizeLinear: the final float LayerNorm on exactly the program's input."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    env = prog.run_integer({"src": x})
    feeds = {"src": x}
    for n in m.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] != "src":
            t = prog.tensors[prog.onnx_tensors[n.output[0]]]
            feeds[n.output[0]] = env[t.name]
            m.graph.input.append(onnx.helper.make_tensor_value_info(
                n.output[0], onnx.helper.np_dtype_to_tensor_dtype(t.dtype), None))  # fmt: skip
            n.output[0] += "__ort"
    sess = session(m)
    wanted = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in wanted})[0]


def test_encoder_agrees_with_onnx_runtime(encoder, layerwise, node_by_node):
    """Against ORT running the QDQ file node by node (float softmax, float layer norm).

    Layer-wise (each quantized tensor computed by ORT from the program's own input codes): as
    ``test_integer_transformer``, the integer softmax / layer norm approximations are far below
    half a code, so only float ties move a code, by 1: max 1 LSB, >= 99% exact.

    The final float LayerNorm on the program's own codes: its int16 grid has a step of
    ``bound / 32767`` (bound = max |gamma| sqrt(N) + |beta|); the integer normalization is off by
    at most ~2**-16 of a normalized unit plus a 31-bit multiplier, both far below that step, so
    the program is at most one rounding (half a step) plus ORT's float32 rounding away: asserted
    within 1 step.

    Whole encoder (each layer fed its own previous results): flipped codes travel through two
    layers; reported, and bounded in steps of the last LayerNorm's 8-bit input grid."""

    _, model, prog = encoder
    x = _inputs(2, batch=16)
    diffs = layerwise(model, prog, {"src": x})
    every = np.concatenate([d.reshape(-1) for d in diffs.values()])
    print(f"\nlayer-wise: {len(diffs)} quantized tensors, max {every.max()} LSB, "
          f"{(every == 0).mean():.2%} exact, {(every <= 1).mean():.2%} within 1 LSB")  # fmt: skip
    assert every.max() <= 1 and (every == 0).mean() >= 0.99
    (out,) = prog.outputs
    got = prog.run({"src": x})[out.name]
    step = out.tensor.scale
    last = np.abs(got - _ort_from_program_codes(model, prog, x, node_by_node)) / step
    print(f"final layer norm on the program's codes: max {last.max():.3f} int16 steps "
          f"(step {step:.3g})")  # fmt: skip
    assert last.max() <= 1.0
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    # in steps of an 8-bit grid over the same range (what an int8 output would hold)
    whole = np.abs(got - ref.run(None, {"src": x})[0]) / (step * 32767 / 127)
    print(f"whole encoder: max {whole.max():.2f} 8-bit steps, {(whole <= 0.5).mean():.2%} "
          f"within half a step, {(whole <= 1).mean():.2%} within 1")  # fmt: skip
    assert whole.max() <= 3 and (whole <= 1).mean() >= 0.99


def test_integer_mode_is_the_integer_program_bit_for_bit(encoder):
    """``integer_mode`` (its own export and lowering, at this call's shapes) against the
    fixture's ``qb.lower(file).run``, at two batch sizes; fake quantization measured against it
    (float softmax / layer norm: the drift of the ORT comparison above)."""
    qmodel, _, prog = encoder
    x = torch.from_numpy(_inputs(3, batch=6))
    with torch.no_grad():
        fake = qmodel(x).numpy()
    with warnings.catch_warnings():  # without VNNI: the engine-saturation warning of the export
        warnings.simplefilter("ignore")
        with qb.integer_mode(qmodel, float_outputs="dequantize"):
            got = qmodel(x)
            fewer = qmodel(x[:2])
    assert got.shape == (6, 8, 32) and got.dtype == torch.float32
    expected = prog.run({"src": x.numpy()})[prog.outputs[0].name]
    np.testing.assert_array_equal(got.numpy(), expected)
    np.testing.assert_array_equal(fewer.numpy(), expected[:2])
    steps = np.abs(got.numpy() - fake) / (prog.outputs[0].tensor.scale * 32767 / 127)
    print(f"\nfake quantization vs integer program: max {steps.max():.2f} 8-bit steps, "
          f"{(steps <= 1).mean():.2%} within 1")  # fmt: skip
    assert steps.max() <= 3 and (steps <= 1).mean() >= 0.99


def test_pre_norm_encoder_lowers_and_agrees(tmp_path, layerwise, three_emitters):
    """``norm_first=True``: the first LayerNorm reads the graph input, which placement now reads
    on the residual add's grid (``torch/_placement.float_reads_of_inputs``); before, lowering
    refused it ("its input is an unquantized graph input"). The encoder ends with the residual
    add, a quantized output. Layer by layer against ORT: max 1 LSB, >= 99% exact (as above);
    numpy, C and integer ONNX identical."""

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
    model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    qmodel = qb.quantize(model, [torch.randn(*SHAPE) for _ in range(4)], recipe="int8",
                         progress=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qb.export(qmodel, tmp_path / "pre.onnx", example_inputs=torch.zeros(*SHAPE))
    onnx_model = onnx.load(tmp_path / "pre.onnx")
    prog = qb.lower(onnx_model)
    assert len({s.node for s in prog.steps if s.op == "layernorm"}) == 2
    diffs = layerwise(onnx_model, prog, {"src": _inputs(4, batch=8)})
    every = np.concatenate([d.reshape(-1) for d in diffs.values()])
    print(f"\npre-norm layer-wise: max {every.max()} LSB, {(every == 0).mean():.2%} exact")
    assert every.max() <= 1 and (every == 0).mean() >= 0.99
    x = _inputs(5, batch=2) * 3
    three_emitters(prog, {"src": x}, tmp_path, integer_only=False)
