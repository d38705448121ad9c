"""How closely ONNX Runtime runs our QDQ exports: per model, the share of output elements within
0, 1 and 2 LSB of ``qmodel(x)`` (LSB = the output quantizer's scale).

    python examples/ort_agreement.py [--json out.json]

The same models and criterion as ``tests/onnx/test_ort_agreement.py`` (which asserts >= 99.9%
within 1 LSB and nothing beyond 2), printed as numbers for reports.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

import quantbridge as qb
from quantbridge.zoo import TinyTransformer, TwoInputConcat, mobilenetv2_style, resnet18_style


def _two_input_batch(n: int) -> dict:
    return {
        "image": torch.randn(n, 3, 8, 8),
        "extra": torch.randn(n, 6),
        "scale": torch.rand(n, 1) + 0.5,
    }


CASES = {
    "resnet18_style": (
        lambda: resnet18_style(num_classes=100, width=16),
        lambda n: torch.randn(n, 3, 32, 32),
    ),
    "mobilenetv2_style": (
        lambda: mobilenetv2_style(num_classes=100, width=0.35),
        lambda n: torch.randn(n, 3, 32, 32),
    ),
    "tiny_transformer": (
        lambda: TinyTransformer(num_classes=64),
        lambda n: torch.randint(0, 100, (n, 16)),
    ),
    "two_inputs_kwarg_concat": (TwoInputConcat, _two_input_batch),
}


def agreement(name: str, folder: Path, n_eval: int = 256) -> dict:
    make_model, make_batch = CASES[name]
    torch.manual_seed(0)
    # "native" as the test: quantized outputs (the LSB is the output quantizer's scale) and weights
    # this CPU's int8 kernels run exactly
    qm = qb.quantize(make_model(), [make_batch(8) for _ in range(4)], "native", progress=False)
    x = make_batch(n_eval)
    args, kwargs = ((), x) if isinstance(x, dict) else ((x,), {})
    with torch.no_grad():
        y = qm(*args, **kwargs).numpy()
    path = folder / f"{name}.onnx"
    qb.export(qm, path, make_batch(2))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = x if isinstance(x, dict) else {sess.get_inputs()[0].name: x}
    y_ort = sess.run(None, {k: v.numpy() for k, v in feeds.items()})[0]
    err = np.abs(y_ort - y) / list(qm.quantizers().values())[-1].scale.item()
    return {
        "elements": int(err.size),
        "exact": float((err < 1e-3).mean()),
        "within_1_lsb": float((err <= 1.001).mean()),
        "within_2_lsb": float((err <= 2.001).mean()),
        "max_lsb": float(err.max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            results[name] = r = agreement(name, Path(tmp))
            print(
                f"{name:26s} {r['elements']:6d} outputs: exact {r['exact']:.2%}, "
                f"<=1 LSB {r['within_1_lsb']:.3%}, <=2 LSB {r['within_2_lsb']:.3%}, "
                f"max {r['max_lsb']:.2f} LSB"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
