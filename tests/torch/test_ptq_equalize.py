"""Cross-layer equalization (``torch.ptq._equalize``): the float function is unchanged to float32
rounding, and per-tensor weight quantization of a depthwise-separable net gets more accurate."""

from __future__ import annotations

import torch
from torch import nn

import quantbridge as qb
from quantbridge.numerics import PerTensor, QScheme, choose_qparams, fake_quantize
from quantbridge.torch._passes import fold_batchnorm, own_parameters
from quantbridge.torch.ptq._equalize import equalize, find_pairs


class DepthwiseNet(nn.Module):
    """conv -> BN -> relu -> depthwise -> BN -> relu -> 1x1 conv -> BN -> relu -> linear, with
    batch-norm scales spread over 3 decades that the next layer makes up for: after folding,
    channel ranges differ ~1000x while every channel carries signal, the situation (MobileNet's
    depthwise layers) Nagel et al. 2019 describe."""

    def __init__(self, c: int = 16):
        super().__init__()
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.bn2 = nn.BatchNorm2d(c)
        self.pw = nn.Conv2d(c, 2 * c, 1)
        self.bn3 = nn.BatchNorm2d(2 * c)
        self.fc = nn.Linear(2 * c, 10)
        for bn in (self.bn1, self.bn2, self.bn3):
            n = bn.num_features
            bn.weight.data = 10 ** (torch.rand(n, generator=g) * 3 - 1.5)
            bn.bias.data = torch.randn(n, generator=g) * 0.5 + 0.5
            bn.running_mean.data = torch.randn(n, generator=g) * 0.1
        with torch.no_grad():  # the next layer makes up for each scale, as training does:
            self.dw.weight /= self.bn1.weight.reshape(-1, 1, 1, 1)  # every channel matters
            self.pw.weight /= self.bn2.weight.reshape(1, -1, 1, 1)
        self.eval()

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv(x)))
        x = torch.relu(self.bn2(self.dw(x)))
        x = torch.relu(self.bn3(self.pw(x)))
        return self.fc(x.mean((2, 3)))


def _data(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 3, 12, 12, generator=g) for _ in range(n)]


def _recipe(equalize: bool) -> qb.Recipe:
    base = qb.Recipe.preset("int8")
    per_tensor = qb.TensorRecipe(QScheme(8, True, True, True, PerTensor()), "minmax")
    return qb.Recipe(weights=per_tensor, activations=base.activations, equalize=equalize)


def _sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def _captured(model: nn.Module) -> torch.fx.GraphModule:
    gm = torch.export.export(model, (_data(1, 1)[0],)).module()
    own_parameters(gm)
    fold_batchnorm(gm)
    return gm


def test_pairs_found_through_relu_and_depthwise():
    # conv->dw and dw->pw through ReLU; pw->fc goes through a mean: not a pair
    assert len(find_pairs(_captured(DepthwiseNet()))) == 2


def _worst_relative(gm, model, batches) -> float:
    worst = 0.0
    with torch.no_grad():
        for x in batches:
            ref = model.double()(x.double())
            model.float()
            worst = max(worst, float((gm(x).double() - ref).abs().max() / ref.abs().max()))
    return worst


def test_float_function_unchanged_to_float32_rounding():
    model = DepthwiseNet()
    plain, equalized = _captured(model), _captured(model)
    assert equalize(equalized) == 2
    held_out = _data(4, 2)
    # float32 computations of one function differ from its float64 value by float32 rounding
    # (2**-24 relative per op, 4 layers of sums of up to 144 products): 1e-5 of the output's
    # magnitude bounds that with margin, and is 3 orders below one int8 output step (2**-8)
    assert _worst_relative(plain, model, held_out) <= 1e-5
    assert _worst_relative(equalized, model, held_out) <= 1e-5
    with torch.no_grad():  # the weights were really rewritten, and are now balanced
        w_plain, w_eq = plain.get_parameter("dw.weight"), equalized.get_parameter("dw.weight")
        assert not torch.equal(w_plain, w_eq)
        ratio = lambda w: float(w.abs().amax((1, 2, 3)).max() / w.abs().amax((1, 2, 3)).min())  # noqa: E731
        assert ratio(w_eq) < ratio(w_plain) / 10


def test_high_bias_absorption_exact_where_measured():
    model = DepthwiseNet()
    example = _data(1, 1)
    cle_only, absorbed = _captured(model), _captured(model)
    equalize(cle_only)
    equalize(absorbed, [((example[0],), {})])
    # something moved: pw's bias (its input pair dw->pw has an unpadded 1x1 conv as layer2)
    assert not torch.equal(cle_only.get_parameter("pw.bias"), absorbed.get_parameter("pw.bias"))
    # exact on the batch it was measured on (every pre-activation stays above what moved)
    assert _worst_relative(absorbed, model, example) <= 1e-5
    # elsewhere an input can dip below the 3-sigma margin in a channel: measured 7e-5 of the
    # output's magnitude on these inputs, i.e. ~2% of one uint8 output step (2**-8 = 4e-3)
    assert _worst_relative(absorbed, model, _data(4, 2)) <= 2e-4


def _weights_quantized(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with every weight fake-quantized int8 per tensor (activations float): the weight
    error alone."""
    scheme = QScheme(8, True, True, True, PerTensor())
    for name, p in gm.named_parameters():
        if name.endswith("weight"):
            scale, zp = choose_qparams(p.detach().min().numpy(), p.detach().max().numpy(), scheme)
            fq = fake_quantize(
                p.detach(), torch.tensor(scale), torch.tensor(zp), scheme.qmin, scheme.qmax
            )
            p.data.copy_(fq)
    return gm


def test_per_tensor_weight_error_falls():
    model = DepthwiseNet()
    plain, equalized = _captured(model), _captured(model)
    equalize(equalized)
    held_out = _data(4, 2)
    with torch.no_grad():
        ref = torch.cat([model(x) for x in held_out])
        before = _sqnr_db(ref, torch.cat([_weights_quantized(plain)(x) for x in held_out]))
        after = _sqnr_db(ref, torch.cat([_weights_quantized(equalized)(x) for x in held_out]))
    print(f"per-tensor int8 weights, output SQNR: {before:.1f} dB -> {after:.1f} dB with CLE")
    assert after >= before + 20.0, (before, after)  # measured 10.1 -> 37.9 dB


def test_quantize_with_equalize_recipe():
    """End to end through ``quantize``: per-tensor weights and uint8 activations."""
    model = DepthwiseNet()
    calib, held_out = _data(4, 1), _data(4, 2)
    plain = qb.quantize(model, calib, _recipe(False), progress=False)
    equalized = qb.quantize(model, calib, _recipe(True), progress=False)
    with torch.no_grad():
        ref = torch.cat([model(x) for x in held_out])
        before = _sqnr_db(ref, torch.cat([plain(x) for x in held_out]))
        after = _sqnr_db(ref, torch.cat([equalized(x) for x in held_out]))
    print(f"per-tensor int8 weights + uint8 activations: {before:.1f} dB -> {after:.1f} dB")
    assert after >= before + 20.0, (before, after)  # measured 9.8 -> 40.8 dB
