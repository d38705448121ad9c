"""Text lines for the PP-OCRv4 recognizer and the direction classifier, and their task metrics.

Data: the tests' renderer (``tests/onnx/ocr_data.py``: one line of known text per image, 48 px
high, DejaVu fonts, right-padded; flipped by 180 degrees for the classifier's second class), so
the bench's lines are the lines the tests measured. Calibration and evaluation come from
separate seed ranges (``CALIB_SEEDS`` / ``EVAL_SEEDS``).

Metrics (higher is better, fractions in [0, 1]):

* ``lines_read``: the recognizer's fraction of lines read *exactly* (greedy CTC: the best class
  per time step, repeats merged, blanks dropped; the character list from the model's
  ``metadata_props``) against the rendered text. The float model's own fraction is shown beside.
* ``same_label``: the classifier's fraction of lines given the same class as the float model
  (argmax of the two-class output); half of the evaluation lines are upside down.
* ``logit_sqnr_db`` (beside it, not a verdict): SQNR of the classifier's logits against float's,
  read from its softmax output. On 32 lines one flipped line is 3.12 points and the flip is
  decided by the one or two lines whose float margin is near 0 (ocr_cls, 2026-12-01: a line at
  p = 0.61 flipped or not with the torch thread count of ours' calibration); the SQNR measures
  every line (``python -m bench.cls_study``, bench/README.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

REC_WIDTH = 320  # as tests/onnx/test_quantize_onnx_ocr.py
CLS_WIDTH = 192
CALIB_SEEDS = 0  # calibration lines: seeds 0.. (the tests' calibration seeds)
EVAL_SEEDS = (1000, 2000, 3000)  # rec evaluation; cls upright, cls upside down


def _renderer():
    from tests.onnx import ocr_data

    return ocr_data


def missing() -> str | None:
    """Why lines cannot be rendered here (Pillow, DejaVu fonts), or None."""
    return _renderer().missing()


def characters(path: Path) -> list[str]:
    """Index -> character of the recognizer's output (0: CTC blank, a space appended last)."""
    return _renderer().characters(path)


def ctc_greedy(probabilities: np.ndarray, chars: list[str]) -> list[str]:
    """Greedy CTC read-out of ``N x T x C`` outputs: best class per step, repeats merged, blank
    (class 0) dropped."""
    if probabilities.ndim != 3:
        raise ValueError(f"recognizer output has shape {probabilities.shape}; expected N x T x C")
    return _renderer().ctc_decode(probabilities, chars)  # the tests' decoder: the same read-out


def lines_read(probabilities: np.ndarray, texts: list[str], chars: list[str]) -> float:
    """Fraction of lines whose greedy CTC read-out equals the rendered text exactly."""
    read = ctc_greedy(probabilities, chars)
    if len(read) != len(texts):
        raise ValueError(f"{len(read)} read-outs for {len(texts)} lines")
    return float(np.mean([a == b for a, b in zip(read, texts, strict=True)]))


def logit_sqnr_db(ref: np.ndarray, out: np.ndarray) -> float:
    """SQNR (dB) of ``out``'s logits against ``ref``'s, both softmax outputs (samples x classes):
    ``log p`` minus its mean over the classes is the logits minus theirs (softmax forgets only
    that constant), ``10 log10(sum z_ref^2 / sum (z_out - z_ref)^2)`` in float64. Probabilities
    are clipped at float32's smallest normal number (an underflowed class: log 0)."""
    if ref.shape != out.shape:
        raise ValueError(f"outputs of shape {out.shape} against float's {ref.shape}")

    def centred(p: np.ndarray) -> np.ndarray:
        z = np.log(np.maximum(p.astype(np.float64), np.finfo(np.float32).tiny))
        return z - z.mean(-1, keepdims=True)

    z_ref, z_out = centred(ref), centred(out)
    noise = np.sum((z_out - z_ref) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(z_ref**2) / noise))


def same_label(ref: np.ndarray, out: np.ndarray) -> float:
    """Fraction of samples whose argmax class equals the float model's."""
    if ref.shape != out.shape:
        raise ValueError(f"outputs of shape {out.shape} against float's {ref.shape}")
    return float((ref.argmax(-1) == out.argmax(-1)).mean())


def rec_lines(first: int, n: int) -> tuple[np.ndarray, list[str]]:
    """``n`` recognizer lines ``N x 3 x 48 x 320`` from seed ``first`` on, and their texts."""
    return _renderer().lines(range(first, first + n), REC_WIDTH)


def cls_lines(first_upright: int, first_flipped: int, n: int) -> np.ndarray:
    """``n`` (even) classifier lines (48 x 192), upright and upside down alternating, so that any
    run of consecutive lines (a calibration batch) holds both classes."""
    r = _renderer()
    half = n // 2
    upright, _ = r.lines(range(first_upright, first_upright + half), CLS_WIDTH)
    flipped, _ = r.lines(range(first_flipped, first_flipped + half), CLS_WIDTH, flip=True)
    return np.stack([upright, flipped], 1).reshape(2 * half, *upright.shape[1:])


def batches(x: np.ndarray, size: int, name: str) -> list[dict[str, np.ndarray]]:
    """ONNX Runtime feeds of ``size`` samples each."""
    return [{name: x[i : i + size].copy()} for i in range(0, len(x), size)]
