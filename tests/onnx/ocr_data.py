"""Rendered text for the PP-OCR models (noise is no input for them), and their read-outs.

* ``pages(seeds, h, w)``: dark words on a light page, for the detector;
* ``lines(seeds, w)``: one line of known text per image, 48 px high, left-aligned and
  right-padded as PP-OCR's recognizer expects, with the text it shows; flipped by 180 degrees
  on request (the direction classifier's second class);
* ``ctc_decode``: the recognizer's greedy CTC read-out with the character list of the model's
  ``metadata_props``.

Pillow and the DejaVu fonts (Debian ``fonts-dejavu-core``) are required: ``missing()`` says why
not. Preprocessing as in ``../shared/models/README.md``: RGB, ``(v / 255 - 0.5) / 0.5``, NCHW.
"""

from __future__ import annotations

import glob
import random

import numpy as np
import onnx

WORDS = (
    "invoice total amount date quantity price street station number order delivery receipt "
    "engine kernel latency model export window memory integer float paper river garden "
    "2024-11-30 12:45 19.99 3,250.00 No.42 A7-113 +49 page 1/3 0.25mm 128kB www.example.org "
    "The quick brown fox jumps over the lazy dog PACK MY BOX WITH FIVE DOZEN LIQUOR JUGS"
).split()
# fonts whose glyphs the recognizer reads (ExtraLight and Mono oblique are hard even in float)
FONTS = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf")


def fonts() -> list[str]:
    found = glob.glob("/usr/share/fonts/**/DejaVu*.ttf", recursive=True)
    return sorted(p for p in found if p.rsplit("/", 1)[-1] in FONTS)


def missing() -> str | None:
    try:
        import PIL  # noqa: F401
    except ImportError:
        return "Pillow is not installed"
    return None if fonts() else "no DejaVu fonts (apt-get install fonts-dejavu-core)"


def _normalise(images: list[np.ndarray]) -> np.ndarray:
    x = np.stack(images).astype(np.float32)
    return ((x / 255.0 - 0.5) / 0.5).transpose(0, 3, 1, 2).copy()


def pages(seeds, height: int, width: int) -> np.ndarray:
    """``N x 3 x H x W``: lines of words in several fonts and sizes on a light page."""
    from PIL import Image, ImageDraw, ImageFont

    out = []
    for seed in seeds:
        rng = random.Random(seed)
        page = Image.new("RGB", (width, height), tuple(rng.randint(200, 255) for _ in range(3)))
        draw = ImageDraw.Draw(page)
        y = rng.randint(2, 8)
        while y < height - 14:
            size = rng.randint(12, 26)
            font = ImageFont.truetype(rng.choice(fonts()), size)
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
            ink = tuple(rng.randint(0, 80) for _ in range(3))
            draw.text((rng.randint(0, width // 4), y), text, font=font, fill=ink)
            y += size + rng.randint(4, 14)
        out.append(np.asarray(page))
    return _normalise(out)


def lines(seeds, width: int = 320, flip: bool = False) -> tuple[np.ndarray, list[str]]:
    """``N x 3 x 48 x width`` text lines and their texts (1-3 words that fit the width)."""
    from PIL import Image, ImageDraw, ImageFont

    images, texts = [], []
    for seed in seeds:
        rng = random.Random(seed)
        font = ImageFont.truetype(rng.choice(fonts()), rng.randint(26, 32))
        text = rng.choice(WORDS)
        for _ in range(rng.randint(0, 2)):
            longer = f"{text} {rng.choice(WORDS)}"
            if font.getlength(longer) <= width - 16:
                text = longer
        background = tuple(rng.randint(210, 255) for _ in range(3))
        line = Image.new("RGB", (int(font.getlength(text)) + 12, 48), background)
        ink = tuple(rng.randint(0, 70) for _ in range(3))
        ImageDraw.Draw(line).text((6, 24), text, font=font, fill=ink, anchor="lm")
        if line.width > width:  # squeeze to the width, as PP-OCR's resize does
            line = line.resize((width, 48))
        if flip:
            line = line.rotate(180)
        image = np.full((48, width, 3), 127, np.uint8)  # right padding: 0 after normalisation
        image[:, : line.width] = np.asarray(line)[:, :width]
        images.append(image)
        texts.append(text)
    return _normalise(images), texts


def characters(path) -> list[str]:
    """Index -> character of the recognizer's output (0 = CTC blank, a space appended last)."""
    model = onnx.load(str(path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    return ["<blank>"] + meta["character"].split("\n") + [" "]


def ctc_decode(probabilities: np.ndarray, chars: list[str]) -> list[str]:
    """Greedy CTC: the best class per step, repeats merged, blanks dropped."""
    out = []
    for best in probabilities.argmax(-1):
        keep = [c for i, c in enumerate(best) if c != 0 and (i == 0 or c != best[i - 1])]
        out.append("".join(chars[c] for c in keep))
    return out
