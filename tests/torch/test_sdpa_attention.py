"""``F.scaled_dot_product_attention`` and the same attention written out get the same quantizer
placement and the same result (issue 12, part 8; ``torch/_sdpa.py``).

Before, SDPA was one aten op outside the placement tables: both of its matmuls stayed float while
eager attention had an int8 QK^T. Now SDPA is rewritten as eager attention at capture, so the two
forms place the same quantizers, export the same QDQ graph (QK^T int8, the probabilities and
P @ V float) and give the same ONNX Runtime result. Cases: no mask, ``is_causal``, a float
additive mask, a bool mask (the forms Hugging Face, timm and ``nn.MultiheadAttention`` use).
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantbridge as qb
from quantbridge.onnx.inspector import inspect_model

N, D, H = 6, 32, 4


class _Attention(nn.Module):
    def __init__(self, sdpa: bool, mask: str):
        super().__init__()
        self.sdpa, self.mask = sdpa, mask
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.register_buffer("additive", torch.randn(N, N))
        self.register_buffer("allowed", (torch.rand(N, N) > 0.3) | torch.eye(N, dtype=torch.bool))

    def forward(self, x):
        b = x.shape[0]
        q, k, v = self.qkv(x).reshape(b, N, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
        mask = {"float": self.additive, "bool": self.allowed}.get(self.mask)
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, mask, is_causal=self.mask == "causal")
        else:
            s = q @ k.transpose(-2, -1) * (D // H) ** -0.5
            if self.mask == "float":
                s = s + mask
            elif self.mask == "bool":
                s = s.masked_fill(~mask, float("-inf"))
            elif self.mask == "causal":
                s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
            out = s.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, N, D))


def _matmul_inputs(qmodel) -> list[tuple[str, ...]]:
    """Per matmul: 'q' where its operand is read through a quantizer, else 'f'."""
    return [
        tuple("q" if a.op == "call_module" else "f" for a in n.args)
        for n in qmodel.graph.nodes
        if n.target is torch.ops.aten.matmul.default
    ]


@pytest.mark.parametrize("mask", ["none", "causal", "float", "bool"])
def test_sdpa_and_eager_attention_quantize_alike(mask, tmp_path):
    batches = [torch.randn(2, N, D, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    x = torch.randn(3, N, D, generator=torch.Generator().manual_seed(9))
    runs = {}
    for form in ("sdpa", "eager"):
        torch.manual_seed(0)  # the same weights for both forms
        model = _Attention(form == "sdpa", mask).eval()
        qmodel = qb.quantize(model, batches, recipe="native", progress=False)
        assert not any(  # nothing left as one opaque attention op
            n.target is torch.ops.aten.scaled_dot_product_attention.default
            for n in qmodel.graph.nodes
        )
        path = str(tmp_path / f"{form}.onnx")
        qb.export(qmodel, path, example_inputs=batches[0])
        options = ort.SessionOptions()  # node by node: the file's QDQ arithmetic exactly
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        with torch.no_grad():
            float_out, quant_out = model(x).numpy(), qmodel(x).numpy()
        runs[form] = {
            "quantizers": len(qmodel.quantizers()),
            "matmuls": _matmul_inputs(qmodel),
            "ops": collections.Counter(n.op_type for n in onnx.load(path).graph.node),
            "inspect": (
                inspect_model(path).int8_ops.get("MatMul"),
                inspect_model(path).float_ops.get("MatMul"),
            ),  # noqa: E501
            "ort": sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0],
            "torch": quant_out,
            "float": float_out,
        }
    sdpa, eager = runs["sdpa"], runs["eager"]
    # QK^T reads two quantized operands; the probabilities stay float (KEEP_FLOAT_OUTPUT_OPS)
    assert sdpa["matmuls"] == eager["matmuls"] == [("q", "q"), ("f", "q")]
    assert sdpa["quantizers"] == eager["quantizers"]
    for op in ("QuantizeLinear", "DequantizeLinear", "MatMul", "Softmax"):
        assert sdpa["ops"][op] == eager["ops"][op], op
    # int8: the two projections (3-D Linear exports as MatMul) and QK^T; float: P @ V
    assert sdpa["inspect"] == eager["inspect"] == (3, 1)
    # the float models agree to float32 rounding (torch's SDPA kernel scales q and k separately)
    np.testing.assert_allclose(sdpa["float"], eager["float"], rtol=1e-5, atol=1e-5)
    # same codes: ORT runs both files to the same result, and each file computes its QuantModel
    # (the float Softmax / P @ V / projection accumulate in another order: float32 rounding)
    np.testing.assert_allclose(sdpa["ort"], eager["ort"], rtol=1e-5, atol=1e-5)
    for run in (sdpa, eager):
        np.testing.assert_allclose(run["ort"], run["torch"], rtol=1e-5, atol=1e-5)


class _ViewAfterSdpa(nn.Module):
    """``sdpa(...).permute(0, 2, 1, 3).view(...)``: valid on the fused kernels' (B, L, H, E)
    memory layout (Hugging Face Data2Vec-vision, whose ``.contiguous()`` there torch.export drops).
    Regression sweep, 2026-12-02: on the decomposed, contiguous P @ V the ``view`` failed, and
    ``qb.quantize`` refused the model ("view size is not compatible ...")."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 4)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.permute(0, 2, 1, 3).view(b, t, 16))


def test_decomposed_sdpa_keeps_the_kernel_memory_layout():
    torch.manual_seed(0)
    model, data = _ViewAfterSdpa().eval(), [torch.randn(2, 5, 16) for _ in range(2)]
    qm = qb.quantize(model, data)
    with torch.no_grad():
        ref, got = model(data[0]), qm(data[0])
    # int8 QK^T and Linears only (measured 40.9 dB)
    assert float(10 * torch.log10((ref**2).sum() / ((ref - got) ** 2).sum())) > 30


class _FullyMaskedRow(nn.Module):
    """SDPA whose mask hides every key from query row 2 (ModernBERT: a sliding window over a
    padded tail). torch's SDPA returns 0 for such a row. Regression sweep, 2026-12-02: the
    decomposition's plain softmax gave 0 / 0 = NaN there, and ``qb.quantize`` refused the model
    ("observer got non-finite values" at P @ V) though the float model's output was finite."""

    def __init__(self, mask: str):
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        allowed = (torch.rand(N, N) > 0.3) | torch.eye(N, dtype=torch.bool)
        allowed[2] = False
        if mask == "float":
            allowed = torch.zeros(N, N).masked_fill(~allowed, float("-inf"))
        self.register_buffer("mask", allowed)

    def forward(self, x):
        b = x.shape[0]
        q, k, v = self.qkv(x).reshape(b, N, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return self.proj(out.transpose(1, 2).reshape(b, N, D))


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_fully_masked_query_row_quantizes_like_sdpa(mask, tmp_path):
    torch.manual_seed(0)
    model = _FullyMaskedRow(mask).eval()
    batches = [torch.randn(2, N, D, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    x = torch.randn(3, N, D, generator=torch.Generator().manual_seed(9))
    qmodel = qb.quantize(model, batches, recipe="native", progress=False)
    with torch.no_grad():
        ref, got = model(x), qmodel(x)
    # torch's SDPA: attention output 0 on the masked row, so the row is the projection's bias
    torch.testing.assert_close(ref[:, 2], model.proj.bias.expand(3, D), rtol=0, atol=0)
    assert not got.isnan().any()
    # the masked row: the projection's bias through the output quantizer: half its step at most
    (step,) = [
        float(z.scale) for z in qmodel.modules() if getattr(z, "name", "") == "proj/linear_1"
    ]
    torch.testing.assert_close(got[:, 2], ref[:, 2], rtol=0, atol=step / 2 + 1e-7)
    # all rows: int8 projections, QK^T and output, random tiny weights (measured 24.5 dB; a NaN
    # or a wrong masked row would fail above or give far less)
    sqnr = float(10 * torch.log10((ref**2).sum() / ((ref - got) ** 2).sum()))
    assert sqnr > 20
    path = str(tmp_path / "masked.onnx")  # the exported file computes the same (no NaN)
    qb.export(qmodel, path, example_inputs=batches[0])
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(
        sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0], got.numpy(), atol=1e-5
    )


def test_fully_masked_query_row_lowers_to_integers(tmp_path):
    """The decomposed SDPA's ``_safe_softmax`` exports as ``Softmax -> Where(IsNaN(p), 0, p)``
    (``onnx/exporter/_translate.py``), which the integer lowering reads; torchlib's own form
    (``Equal(scores, -inf)``, ``ReduceMin``) was refused ("Equal ... reads masked float scores")."""
    torch.manual_seed(0)
    model = _FullyMaskedRow("bool").eval()
    batches = [torch.randn(2, N, D, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    x = torch.randn(3, N, D, generator=torch.Generator().manual_seed(9)).numpy()
    path = str(tmp_path / "masked.onnx")
    qb.export(qb.quantize(model, batches, recipe="int8", progress=False), path, batches[0])
    prog = qb.lower(path, float_outputs="dequantize")
    options = ort.SessionOptions()  # node by node: the file's QDQ arithmetic exactly
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    (want,), (got,) = sess.run(None, {name: x}), list(prog.run({name: x}).values())
    # measured equal (max difference 0.0): the program computes the file's integers
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert not np.isnan(got).any()
