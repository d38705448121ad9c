"""Natural-image-like inputs and a quickly trained MobileNetV2-style (the bench's ``mobilenetv2``).

Why not random weights on N(0,1) inputs. With random weights (BN statistics measured on its
activations, ``workloads.input_driven_bn``) MobileNetV2-style's logits do not measure a tool:

* i.i.d. inputs are all alike at the scale global pooling keeps. The pooled features of one
  sample are a 7x7 average of a stationary field, so they barely move between samples (std
  0.07 against a mean of 0.30): an output that ignores the input scores 12.99 dB;
* the random network is chaotic: N(0,1) input noise 40 dB below the input comes out 5 dB below
  the logits' input-dependent part (35 dB of gain), so any tool's int8 noise leaves only the
  logits' constant part. Every tool's rows lay within 1.3 dB of 12.99 dB. These images alone,
  without training (10 classes, BN statistics measured on them): input-blind 7.7 dB, but the
  same noise still comes out 4.3 dB below (36 dB of gain).

A trained network is neither: it keeps what tells its inputs apart and is stable to small
perturbations, which is why int8 works at all. So the workload's model is trained, briefly, on
a synthetic task of these images (``train``: which of 10 hues a disc has, in front of a
background of 1/f noise and random objects; 150 SGD steps at 64x64, about 1.5 min on one
loaded core), then its BN statistics are measured at 224x224 (``workloads.input_driven_bn``)
and it is evaluated at 224x224 on images of the same distribution from other seeds. Measured
on the bench's 8 quick evaluation images (session 11, VNNI machine): an output that ignores the
input scores 1.55 dB, the input noise above comes out 56 dB below the input-dependent part (no
gain), ``qb.quantize``'s default scores 31.0 dB (its QuantModel in torch). Training's float
rounding differs by ISA, so the weights do too: on session 16's AVX2-only machine the default
scored 30.6 dB on 16 evaluation images with 64 calibration images, 7.5 with 16 (why the quick
sizes are now the full ones: ``workloads.QUICK``).

Images (``image``): ImageNet-normalized RGB, built as natural images are described
statistically: a 1/f^b amplitude spectrum (b per sample), luminance plus weaker chroma fields,
per-sample contrast, brightness and colour cast, 0-8 ellipses/rectangles of random size
(3-40 % of the side), colour and texture, and the class's disc (15-45 % of the side). Seeded
numpy, no download.
"""

from __future__ import annotations

import colorsys

import numpy as np

MEAN = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]  # ImageNet's normalization
STD = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]
CLASSES = 10
TRAIN_SEED = 5678  # the training images (not BN's 4321, calibration's 1234 or evaluation's 99)


def _pink(rng: np.random.Generator, size: int, slope: float) -> np.ndarray:
    """A size x size field with amplitude spectrum 1/f^slope and random phases, unit std."""
    fy = np.fft.fftfreq(size)[:, None]
    fx = np.fft.rfftfreq(size)[None, :]
    f = np.sqrt(fx**2 + fy**2)
    f[0, 0] = 1.0
    amp = f**-slope
    amp[0, 0] = 0.0
    spec = amp * (rng.standard_normal(amp.shape) + 1j * rng.standard_normal(amp.shape))
    field = np.fft.irfft2(spec, s=(size, size))
    return field / (field.std() + 1e-12)


def _shape_mask(rng: np.random.Generator, yy: np.ndarray, xx: np.ndarray, radius: float):
    """An ellipse or a rectangle of about ``radius`` (fraction of the side), random place,
    aspect and angle."""
    cy, cx = rng.uniform(0, 1, 2)
    aspect, angle = rng.uniform(0.4, 2.5), rng.uniform(0, np.pi)
    u = (xx - cx) * np.cos(angle) + (yy - cy) * np.sin(angle)
    v = (cx - xx) * np.sin(angle) + (yy - cy) * np.cos(angle)
    if rng.random() < 0.5:
        return (u / (radius * aspect)) ** 2 + (v * aspect / radius) ** 2 < 1
    return (np.abs(u) < radius * aspect) & (np.abs(v) < radius / aspect)


def image(rng: np.random.Generator, size: int = 224) -> tuple[np.ndarray, int]:
    """One normalized 3 x size x size image and its class (the hue of its disc)."""
    lum, *chroma = (_pink(rng, size, rng.uniform(0.8, 1.6)) for _ in range(3))
    saturation = rng.uniform(0.0, 0.6)
    mix = np.array([[1, 1, 0], [1, -0.5, 0.866], [1, -0.5, -0.866]]) * [1, saturation, saturation]
    img = np.einsum("ck,khw->chw", mix, np.stack([lum, *chroma]))
    img = img * rng.uniform(0.05, 0.3) + rng.uniform(0.15, 0.85) + rng.normal(0, 0.1, (3, 1, 1))
    yy, xx = np.mgrid[0:size, 0:size] / size
    for _ in range(min(rng.poisson(3), 8)):
        mask = _shape_mask(rng, yy, xx, np.exp(rng.uniform(np.log(0.03), np.log(0.4))))
        texture = _pink(rng, size, rng.uniform(0.5, 1.5)) * rng.uniform(0, 0.15)
        img = np.where(mask, rng.uniform(0, 1, (3, 1, 1)) + texture, img)
    label = int(rng.integers(CLASSES))
    hue = (label + rng.uniform(-0.3, 0.3)) / CLASSES % 1.0
    rgb = colorsys.hsv_to_rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.5, 1.0))
    r, (cy, cx) = rng.uniform(0.15, 0.45), rng.uniform(0.2, 0.8, 2)
    img = np.where((yy - cy) ** 2 + (xx - cx) ** 2 < r * r, np.reshape(rgb, (3, 1, 1)), img)
    img = np.clip(img, 0, 1).astype(np.float32)
    return (img - MEAN) / STD, label


def images(seed: int, n: int, size: int = 224) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images (float32, n x 3 x size x size) and their classes, from ``seed``."""
    rng = np.random.default_rng(seed)
    pairs = [image(rng, size) for _ in range(n)]
    return np.stack([p[0] for p in pairs]), np.array([p[1] for p in pairs])


def image_batches(seed: int, n: int, batch: int = 8, size: int = 224) -> list[np.ndarray]:
    """The images of ``images(seed, n, size)`` in batches (as ``workloads.seeded_randn``)."""
    x = images(seed, n, size)[0]
    return [x[i : i + batch].copy() for i in range(0, n, batch)]


def train(model, steps: int = 150, batch: int = 32, size: int = 64, lr: float = 0.05):
    """``model`` (in place, returned in train mode) trained on the hue task: SGD with momentum
    0.9, cosine learning rate from ``lr``, weight decay 4e-5, fresh images (``TRAIN_SEED``) every
    step. BatchNorms start at weight 1, bias 0 and fresh statistics. One torch thread, so the
    weights do not depend on the machine's thread count."""
    import torch

    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.reset_parameters()
    rng = np.random.default_rng(TRAIN_SEED)
    opt = torch.optim.SGD(model.parameters(), lr, momentum=0.9, weight_decay=4e-5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        for step in range(steps):
            pairs = [image(rng, size) for _ in range(batch)]
            x = torch.from_numpy(np.stack([p[0] for p in pairs]))
            y = torch.tensor([p[1] for p in pairs])
            for group in opt.param_groups:
                group["lr"] = lr * 0.5 * (1 + np.cos(np.pi * step / steps))
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model
