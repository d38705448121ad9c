"""Why a swept timm model (``bench.timm_sweep``) loses SQNR: per activation quantizer, the local
SQNR of its own rounding and clipping on the float model's values (quantizers bypassed, the
values fake-quantized with the quantizer's scale / zero point), and ``qb.sensitivity``'s ranking
(SQNR with only that layer quantized, and with every layer but it).

    PYTHONPATH=src:.:/tmp/timm_pkg:/tmp/tvshim python -m bench.timm_diagnose nfnet_l0 [--sens]

A tensor whose local SQNR is far below the others (an outlier channel stretching its grid, a
concat of two ranges) is where the output's error comes from; a model whose worst local SQNR is
~35-45 dB everywhere is legitimately hard (depth adds the noise up).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from bench.timm_sweep import MODELS, _size, sqnr, unzero_heads


def local_sqnr(q, x) -> list[dict]:
    import quantbridge as qb
    from quantbridge.numerics import fake_quantize
    from quantbridge.torch._quantizer import Quantizer

    rows, hooks = [], []

    def hook(mod, args, _out):
        v = args[0].detach()
        if not v.is_floating_point() or mod.scale is None:
            return
        fq = fake_quantize(v, mod.scale, mod.zero_point, mod.qmin, mod.qmax, mod.axis)
        lo = (mod.qmin - mod.zero_point.float()) * mod.scale
        hi = (mod.qmax - mod.zero_point.float()) * mod.scale
        clipped = float(((v < lo) | (v > hi)).float().mean())
        rows.append(
            {
                "name": mod.name,
                "sqnr": sqnr(v.numpy(), fq.numpy()),
                "clipped": clipped,
                "absmax": float(v.abs().max()),
                "p999": float(v.abs().flatten().kthvalue(max(1, int(0.999 * v.numel()))).values),
                "scale": float(mod.scale.max()),
            }
        )

    for m in q.modules():
        if isinstance(m, Quantizer) and m.kind == "activation":
            hooks.append(m.register_forward_hook(hook))
    try:
        with qb.float_mode(q), torch.no_grad():
            q(x)
    finally:
        for h in hooks:
            h.remove()
    seen, out = set(), []
    for r in rows:  # first call of each quantizer
        if r["name"] not in seen:
            seen.add(r["name"])
            out.append(r)
    return out


def main() -> None:
    import timm

    import quantbridge as qb

    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--sens", action="store_true")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    kwargs = MODELS.get(args.model, {})
    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False, **kwargs).eval()
    unzero_heads(model)
    size = _size(model, kwargs)
    calib = [torch.randn(2, 3, size, size) for _ in range(4)]
    x = torch.randn(2, 3, size, size)
    q = qb.quantize(model, calib, progress=False)
    with torch.no_grad():
        print(f"{args.model}: output SQNR {sqnr(model(x).numpy(), q(x).numpy()):.2f} dB")
    rows = sorted(local_sqnr(q, x), key=lambda r: r["sqnr"])
    sq = np.array([r["sqnr"] for r in rows])
    print(f"{len(rows)} activation quantizers; local SQNR median {np.median(sq):.1f} dB")
    for r in rows[: args.top]:
        print(
            f"  {r['sqnr']:6.1f} dB  clipped {r['clipped']:.1e}  absmax {r['absmax']:.3g}  "
            f"p99.9 {r['p999']:.3g}  scale {r['scale']:.3g}  {r['name']}"
        )
    if args.sens:
        s = qb.sensitivity(q, calib, [x], metric="sqnr", progress=False)
        for row in s.layers[: args.top]:
            print(
                f"  only {row.only_this_quantized:6.1f}  all-but {row.all_but_this_quantized:6.1f}"
                f"  {row.name} ({row.op})"
            )


if __name__ == "__main__":
    main()
