"""Layers with weights that stay float are named in placement's warning (regression sweep,
2026-12-02: each was left float without a word while every Linear around it was quantized): a
recurrent layer (nn.LSTM, nn.GRU, nn.RNN: no int8 cell here), and a matmul / einsum reading a
parameter (``x @ self.proj``: the parameter is no weight to placement). The recurrent case is
asserted in ``tests/onnx/test_import_recurrent.py`` (the CRNN quantized there, then exported and
imported back: one quantize for both)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import quantbridge as qb


class _ParameterProducts(nn.Module):
    """``h @ self.proj`` (OpenAI CLIP's projections) and ``einsum(..., self.w)``: the parameter
    is no weight to placement, the products run in float. (``h @ self.proj.t()`` is a linear
    layer: ``_linear_products``.)"""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Parameter(torch.randn(16, 8) * 0.3)
        self.w = nn.Parameter(torch.randn(8, 4) * 0.3)

    def forward(self, x):
        h = torch.relu(self.fc(x)) @ self.proj
        return torch.einsum("bd,de->be", h, self.w)


def test_product_with_a_parameter_left_float_is_warned():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"2 layer\(s\) with weights stay float.*parameter proj.*"
                      r"parameter w, .*nn.Linear"):  # fmt: skip
        qb.quantize(_ParameterProducts().eval(), [torch.randn(4, 8)])


class _Bfloat16Bias(nn.Module):
    """HF Falcon's ALiBi: ``slopes.bfloat16() * positions`` inside a float32 model, then
    ``.to(float32)`` and added to float32 scores."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        positions = x.abs().sum(-1, keepdim=True).bfloat16()
        bias = torch.tensor(0.5).bfloat16() * positions
        return self.fc(x) + bias.float()


def test_tensors_of_other_float_dtypes_stay_float():
    """Only float32 tensors get quantizers: the bfloat16 product stays bfloat16 and float (ONNX
    Runtime has no QuantizeLinear of bfloat16). Before: a quantizer (float32 out) on it, and
    torch's own dtype check in the captured graph failed at the first call ('Tensor dtype
    mismatch! Expected: BFloat16, Got: float'). The float32 linear and add stay quantized."""
    torch.manual_seed(0)
    model = _Bfloat16Bias().eval()
    batches = [torch.randn(4, 8) for _ in range(2)]
    qm = qb.quantize(model, batches, progress=False)
    x = batches[0]  # within the calibrated ranges: no clipping
    ref, y = model(x), qm(x)
    # int8 noise only: the result's step is ~max|ref| / 255, the input and weight steps add a
    # few of it (measured: 0.5% of max|ref|); a bias left out (up to 5 here) would be far off
    assert (y - ref).abs().max() < 0.05 * ref.abs().max()
    assert any(name.endswith("fc.weight") for name in qm.quantizers())


class _Experts(nn.Module):
    """HF mixture-of-experts with ``experts_implementation='batched_mm'``: each token's expert
    weight picked by index from a 3-D parameter, then ``bmm``."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.w = nn.Parameter(torch.randn(4, 8, 8) * 0.3)

    def forward(self, x):
        ids = self.router(x).argmax(-1)
        return torch.bmm(x.unsqueeze(1), self.w[ids].transpose(1, 2)).squeeze(1)


def test_expert_weights_picked_by_index_are_quantized_not_named_as_float():
    """Session 13: named as float (before, float without a word); now quantized per (expert,
    output channel) (``tests/torch/test_moe_experts.py``), and no longer in the warning."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "stay float" warning
        qm = qb.quantize(_Experts().eval(), [torch.randn(6, 8)], progress=False)
    assert qm.quantizers()["w"].kind == "weight"


class _TalkingHeads(nn.Module):
    """EfficientFormerV2's attention (timm ``efficientformerv2_s0``, sweep 2026-12-02): 1x1 convs
    mix the heads before and after the softmax (``talking_head1`` / ``talking_head2``)."""

    def __init__(self):
        super().__init__()
        self.head1 = nn.Conv2d(4, 4, 1)
        self.head2 = nn.Conv2d(4, 4, 1)
        self.proj = nn.Conv2d(4, 4, 1)

    def forward(self, q, k):
        scores = self.head1(q @ k.transpose(-2, -1))
        return self.proj(torch.relu(self.head2(scores.softmax(dim=-1))))


def test_a_conv_reading_softmax_probabilities_is_quantized(tmp_path):
    """The probabilities stay float for P @ V, but a conv reading them had float input: ONNX
    Runtime ran ``head2`` as a float Conv (its weight Q/DQ in the file), with no warning. Now the
    probabilities get a quantizer where a weighted layer reads them, and ORT runs QLinearConv."""
    import onnx
    import onnxruntime as ort

    torch.manual_seed(0)
    calib = [(torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)) for _ in range(3)]
    q = qb.quantize(_TalkingHeads().eval(), calib)
    path = tmp_path / "th.onnx"
    qb.export(q, path, calib[0], progress=False)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.optimized_model_filepath = str(tmp_path / "th.opt.onnx")
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    # ORT's layout pass suffixes the names (head2_token_5)
    kinds = {n.name: n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node}
    head2 = [op for name, op in kinds.items() if name.startswith("head2")]
    assert head2 == ["QLinearConv"], kinds  # was a float Conv
    q_in, k_in = calib[0]
    names = [i.name for i in sess.get_inputs()]
    got = sess.run(None, {names[0]: q_in.numpy(), names[1]: k_in.numpy()})[0]
    want = q(q_in, k_in).detach().numpy()
    # the output is proj's float result (float outputs). ORT fuses DQ -> Softmax -> Q into
    # QLinearSoftmax, a table kernel off by one code on some probabilities (torch/_ops.py), so
    # the convs after it see inputs a step apart (measured 0.24% of the range): bound 1%
    assert abs(got - want).max() <= 1e-2 * abs(want).max()


class _BloomAttention(nn.Module):
    """HF Bloom's scores: ``baddbmm(alibi, q, k^T, beta=1, alpha=1/sqrt(d))``; q and k are
    activations (Linear outputs), so the scaled sum is a product of activations, no layer."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("alibi", torch.randn(2, 1, 5) * 0.1)

    def forward(self, x):  # x (2 heads, 5, 8)
        scores = torch.baddbmm(self.alibi, self.q(x), self.k(x).transpose(1, 2), beta=1.0,
                               alpha=8**-0.5)  # fmt: skip
        return torch.softmax(scores, -1) @ x


class _ScaledAddmm(nn.Module):
    """A real layer left float: ``addmm(b, h, W, alpha=0.5)`` with W a parameter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w, self.b = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return torch.addmm(self.b, self.fc(x), self.w, alpha=0.5)


def test_bloom_baddbmm_of_activations_is_not_a_layer_left_float():
    """Before: "1 layer(s) with weights stay float ...: beta * bias + alpha * x @ w" named the
    attention scores. A scaled addmm of a parameter is still named."""
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qb.quantize(_BloomAttention().eval(), [torch.randn(2, 5, 8)], progress=False)
    assert not [w for w in caught if "stay float" in str(w.message)]
    with pytest.warns(UserWarning, match=r"1 layer\(s\) with weights stay float.*alpha"):
        qb.quantize(_ScaledAddmm().eval(), [torch.randn(3, 8)], progress=False)
