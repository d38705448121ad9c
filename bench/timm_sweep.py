"""timm sweep (not run by CI): random-init timm models through ``qb.quantize`` (default recipe)
-> ``qb.export`` -> ONNX Runtime, output SQNR against float, and the QuantModel (torch
fake-quant) against the exported file in ONNX Runtime (``qb.compare``, LSB of each tensor).

    PYTHONPATH=src:.:/tmp/timm_pkg:/tmp/tvshim python -m bench.timm_sweep gcvit_xxtiny twins_svt_small
    ... --json out.json --compare

timm is not a dependency: install it with ``pip install --target /tmp/timm_pkg --no-deps`` and
give torchvision a stand-in package (timm imports it; ``ops.misc.FrozenBatchNorm2d`` is all the
swept models use). Inputs are N(0, 1), 4 calibration batches of 2, one test batch of 2.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

# name -> create_model kwargs (small inputs where the architecture allows them)
MODELS = {
    "gcvit_xxtiny": {},
    "twins_svt_small": {"img_size": 128},
    "twins_pcpvt_small": {"img_size": 128},
    "volo_d1_224": {},
    "maxvit_pico_rw_256": {"img_size": 128},
    "mixer_s16_224": {"img_size": 128},
    "cspdarknet53": {},
    "selecsls42b": {},
    "nfnet_l0": {},
    "crossvit_tiny_240": {},
}


def sqnr(ref: np.ndarray, out: np.ndarray) -> float:
    err = np.sum((ref.astype(np.float64) - out) ** 2)
    return float(10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / max(err, 1e-30)))


def unzero_heads(model: torch.nn.Module) -> int:
    """Re-initialize all-zero Linear weights (timm zero-inits the classifier of MLP-Mixer and
    others: the float logits would be exactly 0 and the SQNR undefined); N(0, 0.02)."""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and not m.weight.detach().any():
            torch.nn.init.normal_(m.weight, std=0.02)
            n += 1
    return n


def _size(model, kwargs) -> int:
    if "img_size" in kwargs:
        return int(kwargs["img_size"])
    return int(model.pretrained_cfg.get("input_size", (3, 224, 224))[-1])


def run(name: str, kwargs: dict, do_compare: bool, seed: int = 0) -> dict:
    import onnxruntime as ort
    import timm

    import quantbridge as qb

    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    unzero_heads(model)
    size = _size(model, kwargs)
    calib = [torch.randn(2, 3, size, size) for _ in range(4)]
    x = torch.randn(2, 3, size, size)
    row: dict = {"model": name, "size": size}
    t0 = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = qb.quantize(model, calib, progress=False)
    row["warnings"] = sorted({str(w.message)[:300] for w in caught})
    with torch.no_grad():
        ref = model(x).numpy()
        tq = q(x).numpy()
    path = Path(tempfile.mkdtemp()) / f"{name}.int8.onnx"
    qb.export(q, path, example_inputs=calib[0], progress=False)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    onnx_out = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    row.update(
        sqnr_torch_quant=round(sqnr(ref, tq), 2),
        sqnr_ort=round(sqnr(ref, onnx_out), 2),
        tq_vs_ort_max_abs=float(np.abs(tq - onnx_out).max()),
        path=str(path),
    )
    if do_compare:
        r = qb.compare(q, inputs=x.numpy(), engines=["torch-quant", "ort-ref"])
        worst = r.worst(5)
        row["compare_worst"] = [
            {k: t.get(k) for k in ("name", "layer", "max_lsb", "class")} for t in worst
        ]
        row["first_divergence"] = r.first_divergence
        row["unmatched"] = r.unmatched
        row["max_lsb"] = max((t.get("max_lsb") or 0 for t in r.rows()), default=0)
    row["seconds"] = round(time.time() - t0, 1)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="*", default=list(MODELS))
    p.add_argument("--json")
    p.add_argument("--compare", action="store_true")
    args = p.parse_args()
    rows = []
    for name in args.models:
        try:
            row = run(name, MODELS.get(name, {}), args.compare)
        except Exception as e:  # noqa: BLE001 - a sweep reports and goes on
            row = {"model": name, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        print(json.dumps(row, default=str), flush=True)
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
