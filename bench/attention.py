"""Issue 12 part 8 bench: attention with an int8 QK^T against attention left float, per engine.

    python -m bench.attention                    # seq 128 and 197, 2 encoder layers, d=256
    python -m bench.attention --rounds 30 --threads 1

The model is a pre-norm transformer encoder written with ``F.scaled_dot_product_attention``
(random weights, fixed seed). Two QDQ files of the same QuantModel recipe (``native``: 7-bit
weights, exact on AVX2 CPUs without VNNI):

* ``qk-int8``: what quantbridge now does for SDPA and eager attention alike (``torch/_sdpa.py``):
  QK^T reads two quantized operands (ORT: an int8 MatMul), the probabilities and P @ V float;
* ``attn-float``: both attention matmuls float (SDPA kept as one op at capture: what SDPA got
  before); every projection is int8 in both.

Per engine (ONNX Runtime ``ORT_ENABLE_ALL``; OpenVINO CPU) each file's first output is checked
against ONNX Runtime node by node (graph optimizations off, the file's exact QDQ arithmetic): SQNR
in dB, a file below 30 dB is flagged and its time not reported. Then both files are timed in one
interleaved loop (``bench.suite.timing``) and the bench prints per-round time ratios
``qk-int8 / attn-float`` (below 1: int8 QK^T is faster), and the accuracy of each file against
the float torch model (SQNR dB, on the reference run).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
MIN_SQNR_DB = 30.0  # an engine below this against the node-by-node reference computes another model


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, n, d = x.shape
        h = self.norm1(x)
        q, k, v = self.qkv(h).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Encoder(nn.Module):
    def __init__(self, d: int = 256, heads: int = 4, layers: int = 2):
        super().__init__()
        self.blocks = nn.Sequential(*[_Block(d, heads) for _ in range(layers)])

    def forward(self, x):
        return self.blocks(x)


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    noise = float(np.sum((ref - got) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(ref**2)) / noise)


def _export(form: str, model: nn.Module, calib: list, folder: str) -> str:
    import quantbridge as qb
    from quantbridge.torch import _capture

    keep = _capture.decompose_sdpa
    if form == "attn-float":
        _capture.decompose_sdpa = lambda gm: 0  # SDPA stays one op: its matmuls run float
    try:
        qmodel = qb.quantize(model, calib, recipe="native", progress=False)
    finally:
        _capture.decompose_sdpa = keep
    path = os.path.join(folder, f"{form}.onnx")
    qb.export(qmodel, path, example_inputs=calib[0])
    return path


def _sessions(path: str, threads: int) -> dict:
    import onnxruntime as ort

    out = {}
    ref_opt = ort.SessionOptions()
    ref_opt.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    out["reference"] = ort.InferenceSession(path, ref_opt, providers=["CPUExecutionProvider"])
    opt = ort.SessionOptions()
    opt.intra_op_num_threads, opt.inter_op_num_threads = threads, 1
    opt.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = ort.InferenceSession(path, opt, providers=["CPUExecutionProvider"])
    out["onnxruntime"] = lambda x, s=s: s.run(None, {s.get_inputs()[0].name: x})[0]
    try:
        import openvino as ov

        compiled = ov.Core().compile_model(
            path, "CPU", {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"}
        )
        request = compiled.create_infer_request()
        out["openvino"] = lambda x, r=request: np.array(r.infer([x])[0])
    except Exception as e:  # noqa: BLE001 - reported, the other engine still runs
        print(f"openvino unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    return out


def run(seqs: tuple[int, ...], rounds: int, threads: int, d: int, layers: int) -> dict:
    from bench.suite.timing import interleave, paired_ratio

    torch.set_num_threads(threads)
    results = {}
    for seq in seqs:
        torch.manual_seed(0)
        model = Encoder(d, layers=layers).eval()
        gen = torch.Generator().manual_seed(1)
        calib = [torch.randn(2, seq, d, generator=gen) for _ in range(4)]
        x = torch.randn(1, seq, d, generator=gen)
        xn = x.numpy()
        with torch.no_grad():
            expected = model(x).numpy()
        with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runners, row = {}, {}
            for form in ("qk-int8", "attn-float"):
                engines = _sessions(_export(form, model, calib, folder), threads)
                reference = engines.pop("reference")
                ref = reference.run(None, {reference.get_inputs()[0].name: x.numpy()})[0]
                row[f"{form} vs float dB"] = _sqnr(expected, ref)
                for engine, call in engines.items():
                    agree = _sqnr(ref, call(x.numpy()))
                    row[f"{form} {engine} vs reference dB"] = agree
                    if agree >= MIN_SQNR_DB:
                        runners[f"{engine}/{form}"] = lambda c=call, a=xn: c(a)
            timed = interleave(runners, rounds, same_calls=True)
        for engine in ("onnxruntime", "openvino"):
            a, b = f"{engine}/qk-int8", f"{engine}/attn-float"
            if a in timed and b in timed:
                r = paired_ratio(timed[a]["wall_ms"], timed[b]["wall_ms"])
                row[f"{engine} time qk-int8/attn-float"] = r
                row[f"{engine} ms attn-float"] = float(np.median(timed[b]["wall_ms"]))
        results[seq] = row
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[128, 197])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    results = run(tuple(args.seq), args.rounds, args.threads, args.dim, args.layers)
    for seq, row in results.items():
        print(f"seq {seq} (d={args.dim}, {args.layers} layers, batch 1, {args.threads} thread):")
        for key, value in row.items():
            if isinstance(value, dict):
                print(
                    f"  {key}: median {value['median']:.3f} "
                    f"[{value['min']:.3f}-{value['max']:.3f}] over {value['n']} rounds"
                )
            else:
                print(f"  {key}: {value:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
