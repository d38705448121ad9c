"""Mixture-of-experts weights stacked in one parameter ``[E, O, K]`` and read per token by index,
``W[expert_ids]``, then ``bmm`` (HF transformers' ``experts_implementation='batched_mm'``:
Mixtral, Qwen2-MoE, Qwen3-MoE) are quantized: one weight quantizer on the parameter, before the
gather, one scale per (expert, output channel) (``torch/_experts``). Before: they stayed float,
named in placement's "stay float" warning (0 of 2 expert weights of a Mixtral layer quantized)."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.torch._export_ops import code_extremes
from quantbridge.torch._fakequant import StackedWeightQuantizer

E, C, K = 4, 6, 8  # experts, output channels, inputs


class _Experts(nn.Module):
    """HF's ``_batched_linear``: ``bmm(W[ids], x[..., None])`` with ``W`` ``[E, O, K]``, or
    ``bmm(x[:, None], W[ids])`` with ``W`` ``[E, K, O]`` (``is_transposed``). The expert ids are
    an input, so quantization cannot change the routing."""

    def __init__(self, transposed: bool):
        super().__init__()
        self.transposed = transposed
        # rows of different magnitudes: one scale per (expert, output channel) matters
        scales = torch.logspace(-1, 0.5, E * C).reshape(E, C, 1)
        w = torch.randn(E, C, K) * scales
        self.w = nn.Parameter(w.transpose(1, 2).contiguous() if transposed else w)

    def forward(self, x, ids):
        if self.transposed:
            return torch.bmm(x.unsqueeze(1), self.w[ids]).squeeze(1)
        return torch.bmm(self.w[ids], x.unsqueeze(-1)).squeeze(-1)


def _reference_fake_quant(w: torch.Tensor, out_axis: int, qmin: int, qmax: int) -> torch.Tensor:
    """float64 symmetric fake-quant, one scale per (expert, output channel): ``amax / qmax``."""
    w64 = w.detach().double()
    reduce = 2 if out_axis == 1 else 1  # the contracted axis K
    scale = w64.abs().amax(dim=reduce, keepdim=True) / qmax
    return (w64 / scale).round().clamp(qmin, qmax) * scale


@pytest.fixture(scope="module", params=[False, True], ids=["EOK", "EKO"])
def quantized(request):
    torch.manual_seed(0)
    model = _Experts(request.param).eval()
    batches = [(torch.randn(16, K), torch.randint(0, E, (16,))) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qm = qb.quantize(model, batches, progress=False)
    return model, qm, batches, [str(w.message) for w in caught]


def test_expert_weights_get_one_scale_per_expert_and_output_channel(quantized):
    model, qm, _, caught = quantized
    assert not [m for m in caught if "stay float" in m], caught  # before: "bmm of the parameter w"
    q = qm.quantizers()["w"]
    assert isinstance(q, StackedWeightQuantizer) and q.scheme.symmetric
    assert q.out_axis == (2 if model.transposed else 1)
    assert q.scale.shape == (E * C,)
    with torch.no_grad():
        got = q(model.w).double()
    ref = _reference_fake_quant(model.w, q.out_axis, q.qmin, q.qmax)
    # same codes; the only difference is the float32 rounding of each scale (relative 2**-24,
    # times a code of at most qmax) and of the product: a few ulps of the largest weight
    assert (got - ref).abs().max() <= 1e-6 * model.w.abs().max()
    # the export's saturation check reads the extreme codes, per (expert, output channel) row
    codes = q.quantize_integers(model.w)
    extremes = torch.cat([codes.amin(1), codes.amax(1)])
    assert torch.equal(code_extremes(q, model.w), extremes)


def test_gather_then_product_uses_the_quantized_experts(quantized):
    """The QuantModel's output is the float product with the reference-quantized experts and its
    own input quantizer's x: fake-quant before the gather equals fake-quant after it."""
    model, qm, batches, _ = quantized
    x, ids = batches[0]
    q = qm.quantizers()["w"]
    (xq,) = [m for n, m in qm.quantizers().items() if m.kind == "activation" and n != "w"]
    w_ref = _reference_fake_quant(model.w, q.out_axis, q.qmin, q.qmax)
    with torch.no_grad():
        x_ref = xq(x).double()
        y = qm(x, ids).double()
    if model.transposed:
        expected = torch.bmm(x_ref.unsqueeze(1), w_ref[ids]).squeeze(1)
    else:
        expected = torch.bmm(w_ref[ids], x_ref.unsqueeze(-1)).squeeze(-1)
    # float32 arithmetic in the model against float64 here: K=8 products of ~1e0 terms
    assert (y - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_export_runs_in_onnx_runtime_as_the_quantmodel(quantized, tmp_path):
    """DequantizeLinear(int8 [E*O, K], axis 0) -> Reshape (-> Transpose) -> Gather -> MatMul:
    ONNX Runtime computes the product in float on the dequantized experts (weight-only int8 for
    the experts), the same numbers as the QuantModel."""
    ort = pytest.importorskip("onnxruntime")
    import onnx

    model, qm, batches, _ = quantized
    if not model.transposed:  # CI time: [E, K, O] has the Reshape and the Transpose
        pytest.skip("one orientation exported")
    x, ids = batches[1]
    path = tmp_path / "experts.onnx"
    qb.export(qm, str(path), (x, ids))
    proto = onnx.load(str(path))
    int8 = {i.name: tuple(i.dims) for i in proto.graph.initializer if i.data_type in (2, 3)}
    assert (E * C, K) in int8.values(), int8
    floats = [i.name for i in proto.graph.initializer if i.data_type == 1 and len(i.dims) == 3]
    assert not floats  # no float copy of the experts
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    feeds = dict(zip([i.name for i in sess.get_inputs()], (x.numpy(), ids.numpy()), strict=True))
    got = sess.run(None, feeds)[0]
    with torch.no_grad():
        expected = qm(x, ids).numpy()
    # same dequantized operands, float32 products summed in another order: float32 rounding
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_experts_calibration_never_routed_to_are_not_clipped():
    """The scales come from the parameter, not from the experts calibration happened to pick.
    Before: the gathered ``W[ids]`` got a per-tensor activation quantizer observed on the
    calibration's picks (here experts 0 and 1, |w| <= ~1), so expert 3 (weights 10x larger) was
    clipped to that range at inference (measured: max error 129 on outputs up to 134; now 1.2)."""
    torch.manual_seed(0)
    model = _Experts(False).eval()
    with torch.no_grad():
        model.w[3] *= 10
    batches = [(torch.randn(16, K), torch.randint(0, 2, (16,))) for _ in range(2)]
    # the output float: its range, observed on experts 0 and 1 only, would clip it as well
    recipe = dataclasses.replace(qb.Recipe(), quantize_outputs=False)
    qm = qb.quantize(model, batches, recipe=recipe, progress=False)
    x, ids = batches[0][0], torch.full((16,), 3)  # x within its calibrated range
    with torch.no_grad():
        ref, y = model(x, ids), qm(x, ids)
    # int8-level noise: the input step (~range / 255) and the weight step (per row amax / 63)
    # give about 1% of the output's scale here (measured 0.9%); clipping gave 96%
    assert (y - ref).abs().max() < 0.05 * ref.abs().max()


def test_qat_with_learned_scales_trains_the_experts_and_exports_as_trained(tmp_path):
    """LSQ through the flat view: the experts and their [E*O] scales get gradients, and the
    export after training computes what the trained QuantModel does."""
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    batches = [(torch.randn(16, K), torch.randint(0, E, (16,))) for _ in range(2)]
    qm = qb.prepare_qat(_Experts(True), calib_data=batches, learn_scales=True, progress=False)
    q = qm.quantizers()["w"]
    qm.train()
    y = qm(*batches[0])
    y.square().mean().backward()
    assert qm.get_parameter("w").grad.abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in q.parameters())
    qm.eval()
    path = str(tmp_path / "qat.onnx")
    qb.export(qm, path, batches[0])
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    got = sess.run(None, dict(zip(names, (t.numpy() for t in batches[1]), strict=True)))[0]
    with torch.no_grad():
        expected = qm(*batches[1]).numpy()
    # float32 rounding only (measured: 0.0)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


class _ContractedOverExperts(nn.Module):
    """A 3-D parameter read by index whose product contracts the expert axis: no expert matrix,
    still named as float."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, 4))

    def forward(self, x, ids):
        return torch.bmm(x, self.w[ids].permute(1, 0, 2))


def test_a_product_over_the_expert_axis_stays_float_and_warned():
    torch.manual_seed(0)
    batches = [(torch.randn(4, 3, 4), torch.randint(0, 4, (4,)))]
    with pytest.warns(UserWarning, match=r"bmm of the parameter w, "):
        qm = qb.quantize(_ContractedOverExperts().eval(), batches, progress=False)
    assert not any(isinstance(q, StackedWeightQuantizer) for q in qm.quantizers().values())


@pytest.mark.slow  # transformers import + export of a 1-layer model: ~20 s on two cores
def test_tiny_mixtral_experts_are_int8_and_onnx_runtime_agrees(tmp_path):
    """Random-init Mixtral (hidden 32, 4 experts, batched_mm). Before: 5 of 7 weights quantized,
    gate_up_proj and down_proj float (warned)."""
    tf = pytest.importorskip("transformers")
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    config = tf.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    config._experts_implementation = "batched_mm"  # the form that exports (grouped_mm: no ONNX)
    model = tf.MixtralModel(config).eval()
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(3, 64, (2, 8), generator=g)} for _ in range(3)]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*stay float")
        qm = qb.quantize(model, batches, progress=False)
    stacked = {n for n, q in qm.quantizers().items() if isinstance(q, StackedWeightQuantizer)}
    assert stacked == {"layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj"}
    x = batches[-1]
    path = str(tmp_path / "mixtral.onnx")
    qb.export(qm, path, x)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": x["input_ids"].numpy()})[0]
    with torch.no_grad():
        expected = qm(**x).last_hidden_state.numpy()
    # the same int8 grids and float ops both sides: float32 rounding only (measured: 0.0)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
