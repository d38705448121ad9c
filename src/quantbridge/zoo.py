"""Small reference architectures for the demo, the tests and the benchmarks (random weights).

* ``resnet18_style`` - ResNet-18 layout (BasicBlocks, residual adds, BN, max-pool, avg-pool, fc);
* ``mobilenetv2_style`` - inverted residuals, depthwise convs, ReLU6, residual adds;
* ``TinyTransformer`` - encoder blocks with Linear, explicit ``q @ k^T``, softmax, LayerNorm, GELU;
  ``EncoderStack`` - the same blocks on float token features with a per-token head;
* ``TwoInputConcat`` - two positional inputs and a keyword input, concatenated;
* ``DigitsCNN`` - the demo's CNN for scikit-learn's 8x8 ``load_digits`` images.
* patterns real architectures write that once stayed float (issue 12): ``InplaceBasicBlock``
  (torchvision's ``out += identity``, ``resnet18_inplace``), ``DenseBlockNet`` (DenseNet's
  pre-activation BN and concats after a ReLU-ended stem), ``LinearBN1d`` (LeViT's BatchNorm1d
  after Linear + flatten), ``RepVGGBlock`` (an identity-branch BN), ``tiny_gpt2`` (GPT-2's
  ``Conv1D`` = ``addmm`` with a transposed weight; needs ``transformers``).

No weights are downloaded; these exist so that every path has a real, non-trivial model.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18Style(nn.Module):
    def __init__(self, num_classes: int = 1000, width: int = 64, in_channels: int = 3):
        super().__init__()
        w = width
        self.conv1 = nn.Conv2d(in_channels, w, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        chans = [w, 2 * w, 4 * w, 8 * w]
        cin = w
        for i, c in enumerate(chans):
            stride = 1 if i == 0 else 2
            setattr(
                self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, c, stride), BasicBlock(c, c))
            )
            cin = c
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18_style(num_classes: int = 1000, width: int = 64, seed: int = 0) -> ResNet18Style:
    torch.manual_seed(seed)
    return _randomize_bn(ResNet18Style(num_classes, width)).eval()


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2Style(nn.Module):
    # (expand, channels, repeats, stride) as in MobileNetV2, scaled by ``width``
    CONFIG = [
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    ]

    def __init__(self, num_classes: int = 1000, width: float = 1.0):
        super().__init__()
        c = max(8, int(32 * width))
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU6()
        )
        blocks = []
        for t, ch, n, s in self.CONFIG:
            cout = max(8, int(ch * width))
            for i in range(n):
                blocks.append(InvertedResidual(c, cout, s if i == 0 else 1, t))
                c = cout
        self.features = nn.Sequential(*blocks)
        last = max(64, int(1280 * width))
        self.head = nn.Sequential(
            nn.Conv2d(c, last, 1, bias=False), nn.BatchNorm2d(last), nn.ReLU6()
        )
        self.classifier = nn.Linear(last, num_classes)

    def forward(self, x):
        x = self.head(self.features(self.stem(x)))
        return self.classifier(x.mean((2, 3)))


def mobilenetv2_style(
    num_classes: int = 1000, width: float = 1.0, seed: int = 0
) -> MobileNetV2Style:
    torch.manual_seed(seed)
    return _randomize_bn(MobileNetV2Style(num_classes, width)).eval()


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ff)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ff, dim)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).reshape(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = torch.softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h)), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = self.ln1(x + self.proj(y))
        return self.ln2(x + self.fc2(self.act(self.fc1(x))))


class TinyTransformer(nn.Module):
    def __init__(
        self,
        vocab: int = 100,
        dim: int = 64,
        heads: int = 4,
        layers: int = 2,
        ff: int = 128,
        num_classes: int = 10,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads, ff) for _ in range(layers))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


class TwoInputConcat(nn.Module):
    """``forward(image, extra, *, scale)``: two positional inputs and a keyword input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc_extra = nn.Linear(6, 8)
        self.fc = nn.Linear(16, 4)

    def forward(self, image, extra, *, scale):
        a = torch.relu(self.conv(image)).mean((2, 3))
        b = torch.relu(self.fc_extra(extra * scale))
        return self.fc(torch.cat([a, b], dim=1))


class DigitsCNN(nn.Module):
    """A small CNN for 1x8x8 digit images (10 classes)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.pool(torch.relu(self.bn2(self.conv2(x))))
        x = x + torch.relu(self.conv3(x))
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


def _randomize_bn(model: nn.Module) -> nn.Module:
    """Give BatchNorms non-trivial statistics so random-weight models have realistic ranges."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
            m.weight.data.copy_(torch.rand(n, generator=g) * 0.5 + 0.5)
            m.bias.data.copy_(torch.randn(n, generator=g) * 0.1)
    return model


class InplaceBasicBlock(BasicBlock):
    """torchvision's BasicBlock as written there: ``ReLU(inplace=True)``, ``out += identity``
    (same layers as ``BasicBlock``, in-place forward)."""

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


def resnet18_inplace(num_classes: int = 1000, width: int = 64, seed: int = 0) -> ResNet18Style:
    """``resnet18_style`` with torchvision's in-place BasicBlocks."""
    torch.manual_seed(seed)
    model, cin = ResNet18Style(num_classes, width), width
    for i, c in enumerate([width, 2 * width, 4 * width, 8 * width]):
        blocks = [InplaceBasicBlock(cin, c, 1 if i == 0 else 2), InplaceBasicBlock(c, c)]
        setattr(model, f"layer{i + 1}", nn.Sequential(*blocks))
        cin = c
    return _randomize_bn(model).eval()


class DenseLayer(nn.Module):
    """torchvision's _DenseLayer: pre-activation BN -> ReLU -> 1x1 conv -> BN -> ReLU -> 3x3 conv
    on the concat of all earlier features."""

    def __init__(self, cin: int, growth: int = 8, bn_size: int = 2):
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(bn_size * growth), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = self.relu1(self.norm1(torch.cat(features, 1)))
        return self.conv2(self.relu2(self.norm2(self.conv1(x))))


class DenseBlockNet(nn.Module):
    """DenseNet's stem and one dense block: conv0 -> norm0 -> relu0 -> pool0, then layers whose
    concats mix the ReLU-ended stem output with conv outputs holding negative values; norm5."""

    def __init__(self, c0: int = 8, growth: int = 8, layers: int = 3):
        super().__init__()
        self.conv0, self.norm0 = nn.Conv2d(3, c0, 3, padding=1, bias=False), nn.BatchNorm2d(c0)
        self.relu0, self.pool0 = nn.ReLU(inplace=True), nn.MaxPool2d(2)
        self.layers = nn.ModuleList(DenseLayer(c0 + i * growth, growth) for i in range(layers))
        self.norm5 = nn.BatchNorm2d(c0 + layers * growth)

    def forward(self, x):
        features = [self.pool0(self.relu0(self.norm0(self.conv0(x))))]
        for layer in self.layers:
            features.append(layer(features))
        return self.norm5(torch.cat(features, 1))


class LinearBN1d(nn.Module):
    """LeViT's Linear_BN: Linear on (B, N, C), BatchNorm1d over ``flatten(0, 1)``, reshaped back;
    a head BatchNorm1d on pooled (B, C) features before the classifier."""

    def __init__(self, c: int = 16, num_classes: int = 10):
        super().__init__()
        self.linear, self.bn = nn.Linear(c, c), nn.BatchNorm1d(c)
        self.head_bn, self.head = nn.BatchNorm1d(c), nn.Linear(c, num_classes)

    def forward(self, x):
        y = self.bn(self.linear(x).flatten(0, 1)).reshape_as(x)
        return self.head(self.head_bn(y.mean(1)))


class RepVGGBlock(nn.Module):
    """RepVGG's training-time block: 3x3 conv-BN + 1x1 conv-BN + an identity BN, summed, ReLU."""

    def __init__(self, c: int):
        super().__init__()
        self.dense = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))
        self.one = nn.Sequential(nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))
        self.identity = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.dense(x) + self.one(x) + self.identity(x))


class EncoderStack(nn.Module):
    """``EncoderBlock`` s on float (batch, tokens, dim) inputs and a per-token Linear head: every
    LayerNorm output feeds a quantized layer, so the whole model lowers to an integer-only
    program (a lone block ends in a float LayerNorm, which no integer program can output)."""

    def __init__(self, dim: int = 32, heads: int = 4, ff: int = 64, blocks: int = 2, out: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads, ff) for _ in range(blocks))
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _LastHidden(nn.Module):
    """A Hugging Face model called with ``input_ids``, returning ``last_hidden_state``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.gpt2 = model

    def forward(self, input_ids):
        return self.gpt2(input_ids=input_ids, use_cache=False).last_hidden_state


def tiny_gpt2(
    n_embd: int = 64, n_head: int = 4, vocab_size: int = 200, n_positions: int = 32, seed: int = 0
) -> nn.Module:
    """``transformers.GPT2Model`` from a 2-layer config (random weights) in eval mode, called as
    ``model(input_ids)``. ImportError without ``transformers``."""
    import transformers  # optional dependency: only this builder needs it

    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, n_positions=n_positions,
        use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _LastHidden(transformers.GPT2Model(config).eval()).eval()
