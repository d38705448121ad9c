"""Rendered text images for the PP-OCRv4 detection model (noise is no input for it).

Each image: a light background (flat colour, a gradient, or a paper-like speckle), 3 to 9 lines of
words in DejaVu fonts (sans, serif, mono; regular, bold, oblique) at 14 to 44 px, dark ink
colours, random positions, a few lines on a coloured band, sometimes a slight rotation of the
whole page. Deterministic for a seed. Preprocessing as in ``docs/models.md``:
RGB, ``(v / 255 - 0.5) / 0.5``, NCHW float32; H and W multiples of 32.
"""

from __future__ import annotations

import glob
import random

import numpy as np

WORDS = (
    "invoice total amount date quantity price street station number order delivery receipt "
    "quantization engine kernel latency model export calibration window memory integer float "
    "Bahnhof Straße café naïve 2024-11-30 12:45 €19.99 $3,250.00 No. 42 ID: A7-113 Tel +49 "
    "The quick brown fox jumps over the lazy dog PACK MY BOX WITH FIVE DOZEN LIQUOR JUGS "
    "monday tuesday page 1/3 chapter section figure table 0.25 mm 3.7x 128 kB www.example.org"
).split()
FONT_GLOBS = ("/usr/share/fonts/truetype/dejavu/DejaVu*.ttf", "/usr/share/fonts/**/DejaVu*.ttf")


def fonts() -> list[str]:
    found: list[str] = []
    for pattern in FONT_GLOBS:
        found += glob.glob(pattern, recursive=True)
    return sorted(set(found))


def missing() -> str | None:
    """Why images cannot be rendered here, or None."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        return "Pillow is not installed (pip install 'quantbridge[bench]')"
    if not fonts():
        return "no DejaVu fonts (apt-get install fonts-dejavu-core)"
    return None


def _background(rng: random.Random, size: int) -> np.ndarray:
    kind = rng.choice(("flat", "gradient", "speckle"))
    base = np.array([rng.randint(200, 255) for _ in range(3)], dtype=np.float32)
    if kind == "flat":
        img = np.broadcast_to(base, (size, size, 3)).copy()
    elif kind == "gradient":
        ramp = np.linspace(0.0, rng.uniform(20, 60), size, dtype=np.float32)[:, None, None]
        img = np.broadcast_to(base, (size, size, 3)) - ramp
    else:
        noise = np.random.default_rng(rng.randint(0, 2**31)).normal(0, 8, (size, size, 1))
        img = base + noise.astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def render(seed: int, size: int = 480) -> np.ndarray:
    """One ``size x size`` RGB uint8 image of text lines."""
    from PIL import Image, ImageDraw, ImageFont

    rng = random.Random(seed)
    paths = fonts()
    image = Image.fromarray(_background(rng, size))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(3, 9)):
        font = ImageFont.truetype(rng.choice(paths), rng.randint(14, 44))
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
        x, y = rng.randint(0, size // 3), rng.randint(0, size - 30)
        if rng.random() < 0.25:  # a coloured band behind the line
            box = draw.textbbox((x, y), text, font=font)
            band = tuple(rng.randint(150, 230) for _ in range(3))
            draw.rectangle((box[0] - 4, box[1] - 4, box[2] + 4, box[3] + 4), fill=band)
        ink = tuple(rng.randint(0, 90) for _ in range(3))
        draw.text((x, y), text, font=font, fill=ink)
    if rng.random() < 0.3:
        image = image.rotate(rng.uniform(-6, 6), fillcolor=(235, 235, 235))
    return np.asarray(image.convert("RGB"))


def batch(seeds: range | list[int], size: int = 480) -> np.ndarray:
    """``N x 3 x size x size`` float32, normalised for the PP-OCR detector."""
    images = np.stack([render(s, size) for s in seeds]).astype(np.float32)
    return ((images / 255.0 - 0.5) / 0.5).transpose(0, 3, 1, 2).copy()
