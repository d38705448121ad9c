"""Cost of ``qb.compare`` (issue 11, "Performance"): wall time and peak memory of a full compare
with every intermediate quantized tensor captured, against running the same engines once on the
same inputs without capture.

    python -m bench.debug_compare [--model resnet18|minilm|FILE.onnx] [--batch 8] [--size 224]
           [--engines ort-ref,ort,ort-qop,integer] [--inputs SAMPLES.npz]
    python -m bench.debug_compare --model minilm --batch 4 --engines ort-ref,ort,ort-qop,openvino

Each measurement runs in a fresh process (peak RSS is per process), after the libraries are
imported and the model file is written, so both clocks see the same work: load + run (plain),
load + capture + compare (compare). The quantized file is made once (ResNet-18-style from
``quantbridge.zoo``, random weights, 'native' recipe, N(0,1) inputs; or MiniLM-L6 with the
recipe of ``examples/minilm.py``, 32 calibration sentences, ``--batch`` held-out sentences padded
to 64 tokens), or given. MiniLM needs its local model folder (``examples/minilm.py``); the
integer engine cannot lower it (Softmax, LayerNorm), so leave it out of ``--engines``.

Measured (2 cores at load 13-18, peak = VmHWM of each child):

| model, engines | plain s / MB | compare s / MB | time / memory |
|---|---|---|---|
| ResNet-18-style b8 224, ort-ref,ort,ort-qop,integer | 40.6 / 733 | 94.5 / 1220 | 2.33x / 1.66x |
| MiniLM b4 x 64 tokens, ort-ref,ort,ort-qop,openvino | 47.2 / 773 | 82.2 / 888 | 1.74x / 1.15x |

(``python -m bench.debug_compare --batch 8 --size 224``;
``python -m bench.debug_compare --model minilm --batch 4 --engines ort-ref,ort,ort-qop,openvino``.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _plain(model_path: str, inputs: dict, engines: list[str]) -> None:
    """The engines once, outputs only: what a user runs without compare."""
    import onnx

    import quantbridge as qb
    from quantbridge.engine._backends import make_session

    model = onnx.load(model_path)
    for engine in engines:
        if engine in ("ort-ref", "ort"):
            level = "disable" if engine == "ort-ref" else "all"
            make_session(
                "onnxruntime", model.SerializeToString(), None, {"optimization": level}
            ).run(inputs)
        elif engine == "ort-qop":
            folded = qb.fold(model).SerializeToString()
            make_session("onnxruntime", folded, None, {}).run(inputs)
        elif engine == "openvino":
            make_session("openvino", model.SerializeToString(), None, {}).run(inputs)
        elif engine == "integer":
            qb.lower(model).run(inputs)
        elif engine == "torch-quant":
            import torch

            qb.import_onnx(model)(*(torch.from_numpy(v) for v in inputs.values()))


def _child(mode: str, model_path: str, inputs_path: str, engines: list[str]) -> dict:
    import quantbridge as qb  # noqa: F401  (imported before the clock)
    from bench.suite.cost_child import peak_rss_kib  # VmHWM: ru_maxrss holds the parent's peak

    with np.load(inputs_path) as f:
        inputs = {k: f[k] for k in f.files}
    base = peak_rss_kib()
    start = time.perf_counter()
    if mode == "plain":
        _plain(model_path, inputs, engines)
        extra = {}
    else:
        r = qb.compare(model_path, inputs=inputs, engines=engines)
        extra = {"tensors": len(r.tensors), "errors": r.errors,
                 "first_divergence": r.first_divergence}  # fmt: skip
    wall = time.perf_counter() - start
    peak = peak_rss_kib()
    return {"mode": mode, "wall_s": wall, "peak_rss_mb": peak / 1024,
            "rss_growth_mb": (peak - base) / 1024, **extra}  # fmt: skip


def _make_resnet(path: Path, batch: int, size: int) -> dict:
    import torch

    import quantbridge as qb
    from quantbridge.zoo import resnet18_style

    torch.manual_seed(0)
    model = resnet18_style().eval()
    calib = [torch.randn(batch, 3, size, size) for _ in range(2)]
    qmodel = qb.quantize(model, calib, recipe="native")
    qb.export(qmodel, path, example_inputs=calib[0])
    return {"x": np.random.default_rng(1).standard_normal((batch, 3, size, size), np.float32)}


def _make_minilm(path: Path, batch: int) -> dict:
    root = Path(__file__).resolve().parent.parent / "examples"
    sys.path.insert(0, str(root))
    import minilm
    from sentences import split

    embedder, tokenizer = minilm.load_embedder()
    calib_s, eval_s = split(32, batch)
    batches = minilm.batched(tokenizer, calib_s, 8, 64, "max_length")
    qmodel = minilm.quantize_embedder(embedder, batches, minilm.make_recipe(), "max_length")
    minilm.export_int8(qmodel, path, batches[0], "max_length")
    feeds = minilm.tokenize(tokenizer, eval_s, 64, "max_length")
    return {k: np.asarray(v) for k, v in feeds.items() if k in minilm.INPUT_NAMES}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--inputs", help="samples .npz for a given model file")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--engines", default="ort-ref,ort,ort-qop,integer")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        mode, model_path, inputs_path, engines = args.child
        print(json.dumps(_child(mode, model_path, inputs_path, engines.split(","))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.model in ("resnet18", "minilm"):
            model_path = Path(tmp) / f"{args.model}.int8.onnx"
            if args.model == "resnet18":
                inputs = _make_resnet(model_path, args.batch, args.size)
            else:
                inputs = _make_minilm(model_path, args.batch)
            inputs_path = Path(tmp) / "inputs.npz"
            np.savez(inputs_path, **inputs)
        else:
            model_path, inputs_path = Path(args.model), Path(args.inputs)
        rows = []
        for mode in ("plain", "compare"):
            cmd = [sys.executable, "-m", "bench.debug_compare", "--child", mode, str(model_path),
                   str(inputs_path), args.engines]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    plain, full = rows
    print(json.dumps({"model": args.model, "engines": args.engines, "plain": plain,
                      "compare": full, "time_ratio": full["wall_s"] / plain["wall_s"],
                      "peak_ratio": full["peak_rss_mb"] / plain["peak_rss_mb"]}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
