"""Ops the architecture sweeps found refused by ``lower`` (session 13): a 3-D convolution (a
video block), a 1-D transposed convolution (an upsampler), 1-D average / max pools (SEW's
squeeze), a softmax over a non-last axis (ConvBERT's span kernel). Each on a small torch model
quantized, exported and lowered, the program compared with ONNX Runtime on the QDQ file layer by
layer (each layer fed the program's own codes: ``conftest.layerwise_lsb``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import quantbridge as qb


def _lowered(model: nn.Module, shape: tuple[int, ...], tmp_path, seed: int = 0):
    torch.manual_seed(seed)
    calib = [torch.randn(*shape) for _ in range(4)]
    qmodel = qb.quantize(model.eval(), calib, progress=False)
    path = tmp_path / "q.onnx"
    qb.export(qmodel, path, calib[0])
    import onnx

    onnx_model = onnx.load(str(path))
    feeds = {onnx_model.graph.input[0].name: torch.randn(*shape).numpy()}
    return onnx_model, qb.lower(onnx_model), feeds


class VideoBlock(nn.Module):
    """A Conv3d stem (VideoMAE's tubelet embedding is a strided Conv3d) and a (1, 3, 3) conv."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv3d(3, 8, (2, 3, 3), stride=(2, 2, 2), padding=(0, 1, 1))
        self.conv = nn.Conv3d(8, 8, (1, 3, 3), padding=(0, 1, 1), groups=2)

    def forward(self, x):
        return self.conv(torch.relu(self.stem(x)))


class Upsampler(nn.Module):
    """A 1-D decoder stage: Conv1d, then a ConvTranspose1d doubling the length."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.up = nn.ConvTranspose1d(16, 8, 4, stride=2, padding=1)

    def forward(self, x):
        return self.up(torch.relu(self.conv(x)))


class Pools1d(nn.Module):
    """SEW's squeeze (``AvgPool1d(k, k)``), a padded average pool and a max pool."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.squeeze = nn.AvgPool1d(2, 2)
        self.avg = nn.AvgPool1d(3, stride=2, padding=1, count_include_pad=False)
        self.max = nn.MaxPool1d(3, stride=1, padding=1)

    def forward(self, x):
        h = self.conv(x)
        return torch.cat([self.squeeze(h), self.avg(h), self.max(h)[..., ::2]], dim=1)


class SpanKernel(nn.Module):
    """ConvBERT's dynamic span kernel: a Linear gives one weight per kernel tap, softmax over
    the taps (axis 1 of (B*T*heads, taps, 1)), times the unfolded values."""

    def __init__(self, taps: int = 9):
        super().__init__()
        self.taps = taps
        self.kernel = nn.Linear(32, 4 * taps)
        self.values = nn.Linear(32, 4 * 8 * taps)

    def forward(self, x):
        b, t, _ = x.shape
        k = self.kernel(x).reshape(b * t * 4, self.taps, 1)
        k = torch.softmax(k, dim=1)
        v = self.values(x).reshape(b * t * 4, 8, self.taps)
        return torch.matmul(v, k).reshape(b, t, 32)


class Rotary(nn.Module):
    """GPT-J / CodeGen rotary embedding: ``q * cos + rotate_every_two(q) * sin`` where
    ``rotate_every_two`` is ``stack((-q[..., 1::2], q[..., ::2]), -1).flatten(-2)``."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.o = nn.Linear(16, 16)
        angles = torch.arange(8)[:, None] * 0.3 * torch.arange(1, 17)[None, :] / 16
        self.register_buffer("sin", torch.sin(angles))
        self.register_buffer("cos", torch.cos(angles))

    def forward(self, x):
        q = self.q(x)
        rotated = torch.stack((-q[..., 1::2], q[..., ::2]), dim=-1).flatten(-2)
        y = q * self.cos + rotated * self.sin
        return self.o(y)


class WrittenOutLayerNorm(nn.Module):
    """Cohere's LayerNorm: mean, ``(x - mean).pow(2).mean()``, ``rsqrt(var + eps)``, weight."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.weight = nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x):
        h = self.proj(x)
        mean = h.mean(-1, keepdim=True)
        variance = (h - mean).pow(2).mean(-1, keepdim=True)
        return self.weight * ((h - mean) * torch.rsqrt(variance + 1e-5))


class SelectiveScanStep(nn.Module):
    """Mamba's ``dt_proj.weight @ x`` (a parameter on the left: placement leaves it float),
    ``softplus`` (exported with its threshold: Greater / Where), and SEW's GELU padded as the
    output."""

    def __init__(self):
        super().__init__()
        self.x_proj = nn.Linear(8, 4)
        self.dt_weight = nn.Parameter(torch.randn(16, 4) * 0.5)
        self.up = nn.Linear(8, 8)

    def forward(self, x):
        dt = self.dt_weight @ self.x_proj(x).transpose(1, 2)  # (B, 16, L)
        gate = nn.functional.softplus(dt)
        out = nn.functional.pad(nn.functional.gelu(self.up(x)), (0, 3))
        return gate, out


class AlibiAttention(nn.Module):
    """Bloom's attention scores: ``baddbmm(alibi, q, k^T, alpha=1/sqrt(d))`` plus a causal
    mask of finfo.min, softmax, then ``@ v``."""

    def __init__(self, t: int = 6):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        slopes = torch.tensor([0.5, 0.25])[:, None, None]
        self.register_buffer("alibi", (slopes * torch.arange(t)[None, None, :]).repeat(2, 1, 1))
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        self.register_buffer("mask", torch.zeros(t, t).masked_fill(causal, -3.4e38))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4).reshape(3, b * 2, t, 8)
        scores = torch.baddbmm(self.alibi, q, k.transpose(1, 2), beta=1.0, alpha=8**-0.5)
        probs = torch.softmax(scores.reshape(b, 2, t, t) + self.mask, dim=-1)
        return torch.matmul(probs.reshape(b * 2, t, t), v).reshape(b, 2 * t * 8)


@pytest.mark.parametrize(
    ("model", "shape", "limit"),
    [
        # each conv requantizes its exact int32 sum once, as ORT's DQ -> Conv -> Q does in float:
        # at most 1 LSB where ORT's float32 sum rounds an exact tie the other way
        (VideoBlock, (2, 3, 4, 12, 12), 1),
        (Upsampler, (2, 8, 20), 1),
        # averages: the exact window sum requantized once by s_x / (count s_y); ORT's float32 mean
        # can round a tie the other way (1 LSB); the max is the codes themselves (0 LSB)
        (Pools1d, (2, 8, 20), 1),
        # the softmax's int16 probabilities (2**-15) are 256 times finer than the 8-bit output
        # step; the P @ V product requantized once: 1 LSB, as for last-axis attention softmax
        (SpanKernel, (2, 6, 32), 1),
        # -q as a table onto the output grid, rounded once as ORT's float Neg -> Q: 1 LSB at
        # most (a tie); the products as for any quantized Mul
        (Rotary, (2, 8, 16), 1),
        # the variance exact in int64 and its rsqrt thresholds exact against float64: 1 LSB
        # where ORT's float32 chain rounds across a step (``lowering._rms``)
        (WrittenOutLayerNorm, (2, 6, 16), 1),
        # the float weight on int16 codes: its error is 2**-16 of the sum's reach (``_linear``)
        (SelectiveScanStep, (2, 6, 8), 1),
        # scores on int16 codes of 2**-10 (``_normalize.SCORE_STEP``), ALiBi on a grid 256 times
        # finer than theirs: P @ V within 1 LSB, as for the other attention softmaxes
        (AlibiAttention, (2, 6, 16), 1),
    ],
)
def test_refused_ops_now_lower_and_match_ort(
    model, shape, limit, tmp_path, layerwise, node_by_node
):
    """Before (2026-12-02): "3-D convolution is not lowered", "1-D convolution is not lowered"
    (ConvTranspose), "only 2-D pools with explicit pads are lowered", "softmax over axis 1 of a
    rank-3 tensor; only the last axis is lowered", "Concat 'node_stack': operands must be
    quantized tensors ...", "Pow ...: lowered only as a function of one 8-bit tensor and
    scalars", "MatMul ...: its input is a constant", "Greater ...: reads a quantized tensor",
    "Pad ...: the padded tensor must be integer codes", "Mul ...: its input ... is a float value
    computed from quantized tensors" (Bloom's scores times alpha)."""
    onnx_model, prog, feeds = _lowered(model(), shape, tmp_path)
    diffs = layerwise(onnx_model, prog, feeds)
    assert diffs, "no activation QuantizeLinear compared"
    worst = max(int(d.max()) for d in diffs.values())
    assert worst <= limit, {k: int(d.max()) for k, d in diffs.items()}
    # the integer ONNX emission runs in ONNX Runtime and gives the numpy program's codes
    env = prog.run(feeds, integer=True)
    integer_model = prog.to_onnx({k: v.shape for k, v in feeds.items()})
    sess = node_by_node(integer_model)
    codes = prog.run_integer(feeds)
    got = sess.run(None, {b.tensor.name: codes[b.tensor.name] for b in prog.inputs})
    for b, out in zip(prog.outputs, got, strict=True):
        np.testing.assert_array_equal(out, env[b.name])


@pytest.mark.parametrize("op", ["Sin", "Cos"])
def test_sin_cos_of_codes_are_tables(op, qdq_graph, layerwise):
    """Before: "cannot lower ... Sin / Cos" (DETR's sinusoidal features, rotary tables computed
    in the graph). A table computed in float64, rounded once where ORT rounds its float32
    result once: within 1 LSB (a float32 value on the other side of a rounding tie)."""
    g = qdq_graph((2, 64), scale=0.05, zero=128)
    model = g.model(g.quant(g.node(op, [g.x]), 2 / 255, 128))
    feeds = {"x": np.random.default_rng(1).uniform(-6, 6, (2, 64)).astype(np.float32)}
    (d,) = layerwise(model, qb.lower(model), feeds).values()
    assert int(d.max()) <= 1


def test_softmax_over_a_middle_axis_matches_ort(qdq_graph, layerwise):
    """Before: "softmax over axis 1 of a rank-3 tensor; only the last axis is lowered" (this
    graph was the refusal's test). The codes are transposed to the kernel's rows and back; the
    int16 probabilities requantized once to the 8-bit grid: within 1 LSB of ORT's float32."""
    g = qdq_graph((2, 4, 8), scale=0.05, zero=128)
    model = g.model(g.quant(g.node("Softmax", [g.x], axis=1), 1 / 256, 0))
    feeds = {"x": np.random.default_rng(2).normal(0, 2, (2, 4, 8)).astype(np.float32)}
    (d,) = layerwise(model, qb.lower(model), feeds).values()
    assert int(d.max()) <= 1


def test_masked_fill_with_zero_and_division_by_counts(qdq_graph, layerwise):
    """UperNet's pyramid pooling as torch decomposes an adaptive average pool whose sizes do not
    divide: ``masked_fill(mask, 0.0)`` of gathered windows, their sum, ``/ counts`` (a float
    constant tensor). Before: "Where ...: selects float values", then "Div ...: lowered only as
    a function of one 8-bit tensor and scalars". The fill is the code z (exact); the counts'
    reciprocals on int16 codes (error 2**-16 of the product's reach) and the sum rounded once:
    within 1 LSB of ORT."""
    rng = np.random.default_rng(4)
    g = qdq_graph((2, 3, 4), scale=0.05, zero=128)
    mask = g.const(rng.integers(0, 2, (2, 3, 4)).astype(bool))
    filled = g.node("Where", [mask, g.const(np.float32(0.0)), g.x])
    total = g.node("Add", [filled, g.node("Where", [mask, g.x, g.const(np.float32(0.0))])])
    counts = g.const(rng.integers(1, 5, (3, 4)).astype(np.float32))
    model = g.model(g.quant(g.node("Div", [total, counts]), 0.04, 128))
    feeds = {"x": rng.normal(0, 2, (2, 3, 4)).astype(np.float32)}
    (d,) = layerwise(model, qb.lower(model), feeds).values()
    assert int(d.max()) <= 1


class PaddedLinearAttention(nn.Module):
    """EfficientViT (MIT) LiteMLA's ``F.pad(v, (0, 0, 0, 1), value=1)``: a row of ones under
    ``v`` (channels first), so that ``v @ k^T`` carries the sum of ``k`` as its last row. The
    export quantizes the padded ``v`` (a QuantizeLinear reads the Pad); 1 is off ``v``'s grid."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = torch.relu(self.qkv(x)).transpose(-1, -2).chunk(3, dim=1)  # (B, 8, T) each
        v = nn.functional.pad(v, (0, 0, 0, 1), mode="constant", value=1.0)  # (B, 9, T)
        vk = torch.matmul(v, k.transpose(-1, -2))  # (B, 9, 8)
        out = torch.matmul(vk, q)  # (B, 9, T)
        return self.proj(out[:, :-1].transpose(-1, -2) * out[:, -1:].transpose(-1, -2))


def test_pad_with_one_matches_ort(tmp_path, layerwise, three_emitters):
    """Before (2026-12-02): "Pad ...: pads with a constant other than 0 (the code ...): not on
    the tensor's grid" (efficientvit_b0). ``Q(pad(x, 1)) = pad(Q(x), Q(1))`` elementwise: the
    codes requantized to the Pad's QuantizeLinear grid (once, as ORT's DQ -> Q: 1 LSB at a
    tie) and padded with the code of 1 on it; the products as for any quantized MatMul."""
    onnx_model, prog, feeds = _lowered(PaddedLinearAttention(), (2, 6, 8), tmp_path)
    assert any(n.op_type == "Pad" for n in onnx_model.graph.node)
    diffs = layerwise(onnx_model, prog, feeds)
    worst = max(int(d.max()) for d in diffs.values())
    assert worst <= 1, {k: int(d.max()) for k, d in diffs.items()}
    three_emitters(prog, feeds, tmp_path)  # numpy, C and integer ONNX: the same codes


def _padded_graph(qdq_graph, c: float, conv: bool):
    g = qdq_graph((2, 3, 5, 5), scale=0.05, zero=128)
    pads = g.const(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))
    padded = g.node("Pad", [g.x, pads, g.const(np.float32(c))])
    outputs = [g.quant(padded, 0.04, 100)]
    if conv:
        w, bias = g.weight((4, 3, 3, 3)), g.bias(4, 0.05 * 0.02)
        outputs.append(g.quant(g.node("Conv", [padded, w, bias]), 0.1, 128))
    return g.model(*outputs)


def test_pad_with_a_value_on_the_grid_and_off_it(qdq_graph, layerwise):
    """``DQ -> Pad(c)``, read by a QuantizeLinear and a Conv. c = 0.6 is the code 140 on x's
    grid (0.05, 128) and is padded as that code: both readers lower; <= 1 LSB (the Pad's Q
    requantizes once, as ORT's DQ -> Q; the Conv's float32 sum can round a tie the other way).
    c = 0.61 is off the grid: refused where the Conv reads the Pad (it needs codes), lowered
    where only the QuantizeLinear reads it (padded after it with the code of 0.61: <= 1 LSB)."""
    x = np.random.default_rng(5).normal(0, 2, (2, 3, 5, 5)).astype(np.float32)
    on_grid = _padded_graph(qdq_graph, 0.6, conv=True)
    diffs = layerwise(on_grid, qb.lower(on_grid), {"x": x})
    assert len(diffs) == 2 and all(int(d.max()) <= 1 for d in diffs.values()), diffs
    with pytest.raises(qb.LoweringError, match="Conv .*unquantized float result"):
        qb.lower(_padded_graph(qdq_graph, 0.61, conv=True))
    off_grid = _padded_graph(qdq_graph, 0.61, conv=False)
    (d,) = layerwise(off_grid, qb.lower(off_grid), {"x": x}).values()
    assert int(d.max()) <= 1


class LayerNormGelu(nn.Module):
    """MambaOut's stem: conv, LayerNorm over channels last, exact GELU, conv. The export
    quantizes the GELU's output, not the LayerNorm's: GELU reads the float LayerNorm result."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        h = self.norm(self.conv1(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.conv2(nn.functional.gelu(h))


def test_gelu_of_a_float_layer_norm_matches_ort(tmp_path, layerwise, three_emitters):
    """Before (2026-12-02): "Div 'stem.act.Div' ...: lowered only as a function of one 8-bit
    tensor and scalars" (mambaout_femto). The LayerNorm is realized on int16 codes that hold
    every value it can take (half a step of 2**-15 of its bound), GELU a 65536-entry table on
    them rounded once to the 8-bit grid where ORT rounds its float32 GELU once: <= 1 LSB."""
    onnx_model, prog, feeds = _lowered(LayerNormGelu(), (2, 3, 6, 6), tmp_path)
    diffs = layerwise(onnx_model, prog, feeds)
    worst = max(int(d.max()) for d in diffs.values())
    assert worst <= 1, {k: int(d.max()) for k, d in diffs.items()}
    three_emitters(prog, feeds, tmp_path)  # numpy, C and integer ONNX: the same codes


def test_pad_of_codes_with_a_code_other_than_the_zero_point(qdq_graph, layerwise):
    """``Q -> Pad(code 7) -> DQ -> Q``: the constant of a Pad on codes is a code, padded as it
    stands (before: refused unless it was the zero point). Exact: 0 LSB (the same grid)."""
    g = qdq_graph((2, 3, 4, 4), scale=0.05, zero=128)
    s, z = g.const(np.float32(0.05)), g.const(np.array(128, np.uint8))
    codes = g.node("QuantizeLinear", [g.node("Relu", [g.x]), s, z])
    pads = g.const(np.array([0, 0, 1, 0, 0, 0, 0, 2], np.int64))
    padded = g.node("Pad", [codes, pads, g.const(np.array(7, np.uint8))])
    model = g.model(g.quant(g.node("DequantizeLinear", [padded, s, z]), 0.05, 128))
    x = np.random.default_rng(8).normal(0, 2, (2, 3, 4, 4)).astype(np.float32)
    diffs = layerwise(model, qb.lower(model), {"x": x})
    assert diffs and all(int(d.max()) == 0 for d in diffs.values()), diffs


def test_conv_reading_softmax_probabilities_emits_onnx(qdq_graph, layerwise, three_emitters,
                                                       tmp_path):  # fmt: skip
    """EfficientFormerV2's talking head: Softmax -> 1x1 Conv with no QuantizeLinear between,
    so the Conv reads the int16 probabilities (2**-15). Before (2026-12-02): the integer ONNX
    emission failed, "ONNX emitter: int16 operands have no integer kernel" (the numpy program
    ran). The int16 codes are split into two bytes, two exact ConvIntegers (``_int16_sums``):
    the three emitters agree; vs ORT <= 1 LSB (the int16 probabilities are 2**-15, 128 times
    finer than this output step, and the sum is requantized once)."""
    g = qdq_graph((2, 4, 5, 6), scale=0.05, zero=128)
    probs = g.node("Softmax", [g.x], axis=-1)
    w, bias = g.weight((6, 4, 1, 1)), g.bias(6, 2**-15 * 0.02)
    model = g.model(g.quant(g.node("Conv", [probs, w, bias]), 0.004, 128))
    x = np.random.default_rng(9).normal(0, 2, (2, 4, 5, 6)).astype(np.float32)
    prog = qb.lower(model)
    (d,) = layerwise(model, prog, {"x": x}).values()
    assert int(d.max()) <= 1
    three_emitters(prog, {"x": x}, tmp_path)
