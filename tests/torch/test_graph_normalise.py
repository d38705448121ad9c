"""Capture-time graph normalisation: in-place ops made functional (``_passes.out_of_place``, one
test per numbered case plus the schema rule), addmm's weight axis, and standalone batch norms as
depthwise 1x1 convs (``_bn_affine``) - each against the float module it came from."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantbridge.torch._bn_affine import batchnorm_as_conv
from quantbridge.torch._capture import capture
from quantbridge.torch._passes import fold_batchnorm, functional_twin, own_parameters

aten = torch.ops.aten


@pytest.mark.parametrize(
    ("inplace", "functional"),
    [
        (aten.add_.Tensor, aten.add.Tensor),
        (aten.sub_.Tensor, aten.sub.Tensor),
        (aten.mul_.Tensor, aten.mul.Tensor),
        (aten.div_.Tensor, aten.div.Tensor),
        (aten.relu_.default, aten.relu.default),
        (aten.hardtanh_.default, aten.hardtanh.default),
        (aten.clamp_.default, aten.clamp.default),
        (aten.hardswish_.default, aten.hardswish.default),
        (aten.sigmoid_.default, aten.sigmoid.default),
    ],
)
def test_functional_twin_from_the_schema(inplace, functional):
    assert functional_twin(inplace) is functional


@pytest.mark.parametrize("op", [aten.add.Tensor, aten.relu.default, aten.view.default])
def test_functional_ops_have_no_twin(op):
    assert functional_twin(op) is None


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


class _EveryInplace(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        out = self.conv(x)
        out += x.mean(1, keepdim=True)
        out.mul_(0.5).sub_(0.1)
        out.clamp_(-2.0, 3.0)
        nn.functional.hardtanh_(out, -1.0, 2.0)
        return torch.relu_(out)


def test_case1_every_inplace_op_becomes_functional_and_computes_the_same():
    torch.manual_seed(0)
    module, x = _EveryInplace().eval(), torch.randn(2, 3, 6, 6)
    gm = capture(module, (x,), {})
    names = [str(t) for t in _targets(gm)]
    assert not [n for n in names if n.split(".")[1].endswith("_")], names
    for t in ("aten.add.Tensor", "aten.mul.Tensor", "aten.sub.Tensor", "aten.clamp.default",
              "aten.hardtanh.default", "aten.relu.default"):  # fmt: skip
        assert t in names
    with torch.no_grad():
        torch.testing.assert_close(gm(x), module(x), rtol=0, atol=0)  # same ops, same order


class _ReadsAfterWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)

    def forward(self, x):
        a = self.conv(x)
        before = a * 2.0  # the value before the write
        a += 1.0
        return before + a  # the written value


def test_case1_readers_after_the_write_read_the_new_value():
    torch.manual_seed(0)
    module, x = _ReadsAfterWrite().eval(), torch.randn(2, 2, 6, 6)
    gm = capture(module, (x,), {})
    assert aten.add_.Tensor not in _targets(gm)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), module(x), rtol=0, atol=0)


class _WritesAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)

    def forward(self, x):
        a = self.conv(x)
        a[:, :2].relu_()  # in place on a slice: a changes too
        return a


class _WritesTheInput(nn.Module):
    def forward(self, x):
        x.mul_(2.0)
        return x + 1.0


@pytest.mark.parametrize(
    ("module", "kept"),
    [(_WritesAView(), aten.relu_.default), (_WritesTheInput(), aten.mul_.Tensor)],
)
def test_case2_a_view_or_an_input_written_stays_as_captured(module, kept):
    torch.manual_seed(0)
    x = torch.randn(2, 2, 6, 6)
    gm = capture(module.eval(), (x.clone(),), {})
    assert kept in _targets(gm)  # making it functional would drop the write to a / to x
    with torch.no_grad():
        torch.testing.assert_close(gm(x.clone()), module(x.clone()), rtol=0, atol=0)


class _Conv1D(nn.Module):
    """GPT-2's Conv1D: ``addmm(bias, x, weight)`` with weight (in, out)."""

    def __init__(self, nin=6, nout=5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nin, nout))
        self.bias = nn.Parameter(torch.randn(nout))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight)


def test_addmm_weight_is_quantized_per_output_channel_along_the_last_axis():
    import quantbridge as qb
    from quantbridge.torch._fakequant import BiasQuantizer, WeightQuantizer

    torch.manual_seed(0)
    qm = qb.quantize(
        _Conv1D(), [torch.randn(4, 6) for _ in range(2)], progress=False, recipe="int8"
    )
    (wq,) = [q for q in qm.quantizers().values() if isinstance(q, WeightQuantizer)]
    (bq,) = [q for q in qm.quantizers().values() if isinstance(q, BiasQuantizer)]
    w = qm.get_parameter(wq.weight_name)
    assert w.shape == (6, 5) and wq.scale.numel() == 5
    # symmetric per output channel: each column's largest magnitude sits on the top code
    codes = (w / wq.scale.reshape(1, -1)).abs().amax(0)
    torch.testing.assert_close(codes, torch.full((5,), float(wq.qmax)), rtol=1e-5, atol=1e-4)
    assert bq.bias_name.endswith("bias")  # the addmm's first argument got an int32 quantizer


class _StandaloneBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn2d, self.bn1d_flat, self.bn1d_seq = (
            nn.BatchNorm2d(3),
            nn.BatchNorm1d(3),
            nn.BatchNorm1d(3),
        )

    def forward(self, x):
        y = torch.relu(self.bn2d(x))  # pre-activation: no conv before it
        flat = self.bn1d_flat(y.mean((2, 3)))  # (N, C)
        seq = self.bn1d_seq(y.flatten(2))  # (N, C, L)
        return flat.sum() + seq.sum(), flat, seq


def test_standalone_batchnorms_become_depthwise_convs_with_the_same_output():
    torch.manual_seed(0)
    module = _StandaloneBN()
    for bn in (module.bn2d, module.bn1d_flat, module.bn1d_seq):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(-2, 2)
        bn.bias.data.uniform_(-1, 1)
    module.eval()
    x = torch.randn(2, 3, 5, 5)
    gm = capture(module, (x,), {})
    own_parameters(gm)
    assert fold_batchnorm(gm) == 0
    assert batchnorm_as_conv(gm) == 3
    targets = _targets(gm)
    assert aten.batch_norm.default not in targets
    assert targets.count(aten.conv2d.default) == 1 and targets.count(aten.conv1d.default) == 2
    with torch.no_grad():
        for got, want in zip(gm(x), module(x), strict=True):
            # float32: k * x + c against (x - mean) / sqrt(var + eps) * gamma + beta
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_batchnorm_in_training_mode_is_left_alone():
    module = nn.Sequential(nn.ReLU(), nn.BatchNorm2d(3))
    gm = capture(module.eval(), (torch.randn(2, 3, 4, 4),), {})
    for n in gm.graph.nodes:
        if n.target is aten.batch_norm.default:
            n.args = n.args[:5] + (True,) + n.args[6:]
    assert batchnorm_as_conv(gm) == 0


class _StringPadding(nn.Module):
    def __init__(self):
        super().__init__()
        self.same = nn.Conv2d(3, 4, 3, padding="same")
        self.even = nn.Conv2d(4, 4, (4, 2), padding="same", dilation=(1, 3), groups=2)
        self.valid = nn.Conv2d(4, 4, 3, stride=2, padding="valid")
        self.line = nn.Conv1d(4, 4, 2, padding="same", bias=False)
        self.cube = nn.Conv3d(1, 2, 2, padding="same")

    def forward(self, x):
        y = self.valid(self.even(self.same(x)))
        return self.line(y.flatten(2)), self.cube(x[:, :1, None])


def test_string_padding_convs_become_integer_padding_convs_with_the_same_output():
    """``padding="same"`` / ``"valid"`` (``aten.convNd.padding``) become ``aten.convNd.default``
    (an even ``"same"`` kernel: ``constant_pad_nd`` on the right first, as torch computes it):
    the same ops on the same values, so bit-identical, also at a shape not captured."""
    torch.manual_seed(0)
    model = _StringPadding().eval()
    gm = capture(model, (torch.randn(2, 3, 10, 12),), {}, "all")
    targets = _targets(gm)
    assert not [t for t in targets if t.name().endswith(".padding")]
    assert targets.count(aten.constant_pad_nd.default) == 3  # even, line, cube
    x = torch.randn(3, 3, 13, 9)
    for got, want in zip(gm(x), model(x), strict=True):
        assert torch.equal(got, want)


class _FalconLinear(nn.Linear):
    """Hugging Face Falcon's ``FalconLinear``: ``nn.Linear`` with ``input @ self.weight.T``."""

    def forward(self, x):
        h = x @ self.weight.T
        return h if self.bias is None else h + self.bias


class _TransposedProducts(nn.Module):
    def __init__(self, linear=_FalconLinear):
        super().__init__()
        self.a, self.b, self.c = linear(6, 8), linear(8, 8, bias=False), linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.mm(h.flatten(0, 1), self.b.weight.t()).view(h.shape)  # mm(x, t(w)), no bias
        return self.c(h)


def test_products_with_a_transposed_parameter_are_quantized_as_linear_layers():
    """``x @ w.T (+ b)`` (Falcon's linears, ``mm(x, w.t())``) is quantized as the nn.Linear it
    computes: weight and int32 bias quantizers, and the same quantized output, bit for bit, as
    the model written with nn.Linear (same weights, same recipe: the same captured ops). Before:
    no quantizer, every such layer float without a word (HF Falcon: 8 of 8 linears)."""
    import quantbridge as qb
    from quantbridge.torch._fakequant import BiasQuantizer, WeightQuantizer

    torch.manual_seed(0)
    falcon = _TransposedProducts().eval()
    plain = _TransposedProducts(nn.Linear).eval()
    plain.load_state_dict(falcon.state_dict())
    batches = [torch.randn(2, 4, 6) for _ in range(2)]
    qf = qb.quantize(falcon, batches, progress=False)
    qp = qb.quantize(plain, batches, progress=False)
    kinds = [type(q) for q in qf.quantizers().values()]
    assert kinds.count(WeightQuantizer) == 3 and kinds.count(BiasQuantizer) == 2
    x = torch.randn(3, 4, 6)
    assert torch.equal(qf(x), qp(x))
