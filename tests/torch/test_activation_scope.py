"""``Recipe.activation_scope="weighted_inputs"``: only the inputs of weighted ops (linear, conv)
and both operands of activation x activation matmuls get activation quantizers; adds, norms,
softmax, GELU stay float and no output is quantized (``quantbridge.torch._scope``). On a two-block
BERT-like encoder (``zoo.EncoderBlock``: fused qkv, q @ k^T, softmax, P @ V, projection, post-norm
residuals, GELU feed-forward) that is exactly 8 tensors per block, counted by hand below; the
float function is unchanged with the quantizers off; ONNX Runtime computes the same codes at every
quantized read; the recipe round-trips; ``qb.lower`` refuses the file by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.zoo import EncoderBlock

aten = torch.ops.aten
READERS = {aten.linear.default, aten.matmul.default}  # what may read a quantized activation
# per block: the qkv input, q, k, v, the softmax's probabilities, the attention output (proj's
# input), ln1's output (fc1's input), GELU's output (fc2's input)
PER_BLOCK = 8


def _recipe(scope: str = "weighted_inputs") -> qb.Recipe:
    # native weights: 7-bit on CPUs whose u8 x s8 kernels saturate, so ORT's fused kernels are exact
    return dataclasses.replace(qb.Recipe.preset("native"), activation_scope=scope)


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    model = nn.Sequential(EncoderBlock(32, 4, 64), EncoderBlock(32, 4, 64)).eval()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(4, 8, 32, generator=g) for _ in range(2)]
    held = torch.randn(4, 8, 32, generator=g)
    return model, calib, held


@pytest.fixture(scope="module")
def quantized(encoder):
    model, calib, _ = encoder
    return qb.quantize(model, calib, _recipe(), progress=False)


@pytest.fixture(scope="module")
def exported(quantized, encoder, tmp_path_factory):
    path = tmp_path_factory.mktemp("scope") / "weighted_inputs.onnx"
    qb.export(quantized, path, example_inputs=encoder[2])
    return path


def _activation_calls(qmodel) -> list[torch.fx.Node]:
    attrs = {p.attr for p in qmodel.qb_points if p.kind == "activation"}
    return [
        n for n in qmodel.graph.nodes
        if n.op == "call_module" and n.target.split(".")[-1] in attrs
    ]  # fmt: skip


def test_only_weighted_inputs_and_matmul_operands_are_quantized(quantized):
    kinds = [p.kind for p in quantized.qb_points]
    assert kinds.count("activation") == 2 * PER_BLOCK
    assert kinds.count("weight") == kinds.count("bias") == 2 * 4  # qkv, proj, fc1, fc2 per block
    calls = _activation_calls(quantized)
    # every quantized activation is read by a linear (as its input) or a matmul, and nothing else
    for call in calls:
        for user in call.users:
            assert user.target in READERS, f"{call.target} is read by {user.target}"
            if user.target is aten.linear.default:
                assert user.args[0] is call
    # every linear input and every matmul operand is a quantized read
    for n in quantized.graph.nodes:
        if n.op == "call_function" and n.target in READERS:
            operands = n.args[:1] if n.target is aten.linear.default else n.args[:2]
            assert all(a in calls for a in operands), n.name
    # one call per quantizer: each tensor is read quantized once (k after its transpose)
    assert len({c.target for c in calls}) == len(calls) == 2 * PER_BLOCK


class TwoViews(nn.Module):
    """``h`` read by ``fc1`` as it is and by ``fc2`` through a reshape and a transpose."""

    def __init__(self):
        super().__init__()
        self.fc0, self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(6, 4)

    def forward(self, x):
        h = self.fc0(x)  # (2, 6, 8)
        moved = h.reshape(2, 48).reshape(2, 8, 6).transpose(1, 2).transpose(1, 2)
        return self.fc1(h).sum() + self.fc2(moved).sum()


def test_a_tensor_read_through_data_movement_keeps_one_quantizer():
    torch.manual_seed(0)
    q = qb.quantize(TwoViews().eval(), [torch.randn(2, 6, 8)], _recipe(), progress=False)
    assert sum(p.kind == "activation" for p in q.qb_points) == 2  # x and h
    linears = {n.args[1].target: n for n in q.graph.nodes if n.target is aten.linear.default}
    reads = {name.split("_quantbridge.")[-1]: n.args[0].target for name, n in linears.items()}
    assert reads["fc1_weight"] == reads["fc2_weight"] != reads["fc0_weight"], reads


def test_float_function_unchanged_with_quantizers_off(encoder, quantized):
    model, _, held = encoder
    with torch.no_grad(), qb.float_mode(quantized):
        got = quantized(held)
        want = model(held)
    # the same float ops on the same weights: float32 rounding of a recompiled graph at most
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_onnx_has_qdq_only_before_matmul_and_gemm(exported):
    model = onnx.load(exported)
    readers: dict[str, list[str]] = {}
    for node in model.graph.node:
        for t in node.input:
            readers.setdefault(t, []).append(node.op_type)
    quantize = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert len(quantize) == 2 * PER_BLOCK
    for q in quantize:
        (dq,) = [n for n in model.graph.node if q.output[0] in n.input]
        assert dq.op_type == "DequantizeLinear"
        assert set(readers[dq.output[0]]) <= {"MatMul", "Gemm"}, readers[dq.output[0]]


def _torch_codes(qmodel, x) -> dict[str, np.ndarray]:
    """Quantizer attr -> the integer codes its calls produce on ``x`` (every call, in order)."""
    codes: dict[str, list[np.ndarray]] = {}
    hooks = []
    for p in qmodel.qb_points:
        if p.kind != "activation":
            continue
        module = qmodel.get_submodule(f"_quantbridge.{p.attr}")

        def hook(m, args, out, attr=p.attr):
            q = torch.round(out.detach() / m.scale) + m.zero_point
            codes.setdefault(attr, []).append(q.numpy().astype(np.int64))

        hooks.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            qmodel(x)
    finally:
        for h in hooks:
            h.remove()
    return codes


def test_ort_computes_the_same_codes_at_every_quantized_read(quantized, exported, encoder):
    held = encoder[2]
    model = onnx.load(exported)
    quantize = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    model.graph.output.extend(onnx.ValueInfoProto(name=q.output[0]) for q in quantize)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    outs = session.run([q.output[0] for q in quantize], {name: held.numpy()})
    want = _torch_codes(quantized, held)
    compared = 0
    for q, got in zip(quantize, outs, strict=True):
        attr = q.input[1].split(".")[1]  # _quantbridge.<attr>.export_scale
        (ref,) = want[attr]  # one read per quantizer here
        diff = np.abs(got.astype(np.int64) - ref)
        # node by node ORT runs the QDQ arithmetic in float32 as torch does, but sums in another
        # order: a value within float32 rounding of a rounding tie may land one code away (and
        # move the codes after it); never more than 1 LSB, and rare (measured: all exact)
        assert diff.max() <= 1 and (diff == 0).mean() >= 0.99, (attr, diff.max())
        compared += 1
    assert compared == 2 * PER_BLOCK


def test_ort_fused_agrees_with_node_by_node(exported, encoder):
    held = encoder[2].numpy()
    outs = []
    for level in (
        ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    ):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        s = ort.InferenceSession(str(exported), options, ["CPUExecutionProvider"])
        outs.append(s.run(None, {s.get_inputs()[0].name: held})[0])
    # the fused engine multiplies the same int8 codes exactly (7-bit weights on this CPU) and
    # scales the int32 sums in float: float32 rounding, far below any activation step (>= 1e-3)
    assert np.abs(outs[0] - outs[1]).max() <= 1e-4


def test_recipe_round_trip_and_bad_value():
    r = _recipe()
    assert qb.Recipe.from_dict(r.to_dict()) == r
    assert qb.Recipe.from_json(r.to_json()).activation_scope == "weighted_inputs"
    assert "activation_scope" not in qb.Recipe().to_dict()  # old recipes serialise as before
    with pytest.raises(ValueError, match="activation_scope='linears'.*'all', 'weighted_inputs'"):
        qb.Recipe(activation_scope="linears")


def test_lower_refuses_the_file_naming_the_scope(exported):
    with pytest.raises(qb.LoweringError, match="activation_scope='weighted_inputs'"):
        qb.lower(exported)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")
def test_quantize_onnx_places_the_same_reads(encoder, tmp_path):
    """The imported-ONNX path: the same placement on a float file (one block of the encoder)."""
    model, calib, held = encoder
    model = model[0]
    src = tmp_path / "float.onnx"
    torch.onnx.export(model, (held,), src, input_names=["x"], dynamo=False)
    data = {"x": torch.cat(calib).numpy()}
    out = qb.quantize_onnx(src, data, recipe=_recipe(), progress=False)
    quantize = [n for n in out.graph.node if n.op_type == "QuantizeLinear"]
    readers = {t: n.op_type for n in out.graph.node for t in n.input}
    dq = {n.input[0]: n.output[0] for n in out.graph.node if n.op_type == "DequantizeLinear"}
    assert len(quantize) == PER_BLOCK
    assert all(readers[dq[q.output[0]]] in ("MatMul", "Gemm") for q in quantize)


def test_checkpoint_round_trip(quantized, encoder, tmp_path):
    model, _, held = encoder
    path = tmp_path / "q.safetensors"
    qb.save(quantized, path)
    loaded = qb.load(path, model)
    assert loaded.qb_recipe.activation_scope == "weighted_inputs"
    assert [p.attr for p in loaded.qb_points] == [p.attr for p in quantized.qb_points]
    with torch.no_grad():
        torch.testing.assert_close(loaded(held), quantized(held), rtol=0, atol=0)
