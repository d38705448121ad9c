"""Issue 14 measurement: the transformer recipes (SmoothQuant + float outlier residual adds) as
extra quantbridge rows of figure 1, next to every peer, in one bench run.

``python -m bench.transformer_rows --quick --only digits,resnet18,mobilenetv2,minilm --figures
accuracy`` (any ``python -m bench`` arguments) adds these rows to ``peers.configs``:

* ``default before`` - the ``default`` preset without the transformer handling
  (``smoothquant=None``, ``float_outlier_residuals=False``), when the default has it, so
  before/after come from one run;
* ``default + transformer`` - the ``default`` preset plus SmoothQuant "auto" with scope
  ``"transformer"`` (graphs where a LayerNorm feeds a linear; inputs with outlier channels) and
  the outlier residual adds float;
* ``best + transformer`` - the best row (``peers.best_recipe``) plus the same;
* ``best + transformer (all)`` - the best row with SmoothQuant "auto" on every linear input
  (MiniLM only);
* ``weighted inputs`` - ``native`` with ``activation_scope="weighted_inputs"`` (only the inputs
  of linears / convs and both matmul operands quantized, NNCF's transformer layout); ``+
  smoothquant`` with SmoothQuant "auto" (scope ``"transformer"``), ``(all)`` on every linear
  input (MiniLM only); ``default + weighted inputs`` / ``best + weighted inputs`` - the default
  preset / the best row with the scope;

(the bench's own ``transformer (native weights)`` row and NNCF's ``transformer`` row run on
MiniLM in every run, ``bench.suite.peers``).

``bench/results/quick-transformer-rows.json`` (2026-12-01, load 6-14): that run's ``(layer_norm)``
rows used a first form of the scope (every LayerNorm output, no outlier gate; MiniLM 0.9913,
CNNs equal to the rows without it), the ``transformer, native weights`` row is today's
``peers.TRANSFORMER`` (0.9929; NNCF ``transformer`` 0.9957).

``python -m bench.transformer_rows --ort-speed A.onnx B.onnx ...``: ONNX Runtime time of MiniLM
files from a run's ``--work`` folder, interleaved, as ratios to the first (``ort_speed``).

``python -m bench.transformer_rows --tiny``: ``quantbridge.zoo.TinyTransformer`` (random weights,
the tests' tiny transformer) with each recipe above, output SQNR vs float in torch and in ONNX
Runtime (node by node and optimized), 4 calibration and 8 held-out batches of 8 x 16 tokens.
"""

from __future__ import annotations

import dataclasses
import sys

from bench import __main__ as bench_main
from bench.suite import peers

TRANSFORMER = {"smoothquant": "auto", "float_outlier_residuals": True}
MINILM_ONLY = ("best + transformer (all)", "weighted inputs + smoothquant (all)")
WEIGHTED_INPUTS = {"activation_scope": "weighted_inputs"}  # ``torch._scope``
SMOOTH = {"smoothquant": "auto", "smoothquant_scope": "transformer"}


def _default_before():
    import quantbridge as qb

    return dataclasses.replace(
        qb.Recipe.preset("default"), smoothquant=None, float_outlier_residuals=False
    )


def _rows() -> dict:
    return {
        "default before": _default_before,
        "default + transformer": lambda: dataclasses.replace(
            _default_before(), **TRANSFORMER, smoothquant_scope="transformer"
        ),
        "best + transformer": lambda: dataclasses.replace(
            peers.best_recipe(), **TRANSFORMER, smoothquant_scope="transformer"
        ),
        "best + transformer (all)": lambda: dataclasses.replace(
            peers.best_recipe(), **TRANSFORMER, smoothquant_scope="all"
        ),
        "weighted inputs": lambda: dataclasses.replace(_native(), **WEIGHTED_INPUTS),
        "weighted inputs + smoothquant": lambda: dataclasses.replace(
            _native(), **WEIGHTED_INPUTS, **SMOOTH
        ),
        "weighted inputs + smoothquant (all)": lambda: dataclasses.replace(
            _native(), **WEIGHTED_INPUTS, smoothquant="auto"
        ),
        "default + weighted inputs": lambda: dataclasses.replace(
            _default_before(), **WEIGHTED_INPUTS
        ),
        "best + weighted inputs": lambda: dataclasses.replace(
            peers.best_recipe(), **WEIGHTED_INPUTS
        ),
    }


def _native():
    import quantbridge as qb

    return qb.Recipe.preset("native")


def _sqnr(ref, out) -> float:
    import numpy as np

    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    return float(10 * np.log10((ref**2).sum() / max(((ref - out) ** 2).sum(), 1e-300)))


def tiny(log=print) -> dict:
    """The tiny transformer's rows (see the module docstring)."""
    import tempfile
    import warnings
    from pathlib import Path

    import numpy as np
    import torch

    import quantbridge as qb
    from bench.suite.engines import ort_session
    from quantbridge.zoo import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(num_classes=64).eval()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, 100, (8, 16), generator=g) for _ in range(4)]
    held = [torch.randint(0, 100, (8, 16), generator=g) for _ in range(8)]
    with torch.no_grad():
        ref = np.concatenate([model(x).numpy() for x in held])
    recipes = {"default": None, **{n: f() for n, f in _rows().items()}}
    out = {}
    for name, recipe in recipes.items():
        kwargs = {} if recipe is None else {"recipe": recipe}
        q = qb.quantize(model, calib, progress=False, **kwargs)
        with torch.no_grad():
            row = {"torch": _sqnr(ref, np.concatenate([q(x).numpy() for x in held]))}
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = Path(d) / "q.onnx"
            qb.export(q, path, example_inputs=held[0])
            for form, optimize in (("ort node by node", False), ("ort optimized", True)):
                s = ort_session(path, optimize=optimize)
                name_in = s.get_inputs()[0].name
                got = np.concatenate([s.run(None, {name_in: x.numpy()})[0] for x in held])
                row[form] = _sqnr(ref, got)
        row["float rules"] = [r.pattern for r in q.qb_recipe.rules]
        row["smoothed"] = q.qb_capture.get("smoothed")
        out[name] = row
        log(
            f"{name}: "
            + ", ".join(
                f"{k} {v:.2f} dB" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            )
        )
    return out


def ort_speed(files: list[str], rounds: int = 12, log=print) -> dict:
    """ONNX Runtime time of MiniLM-shaped files (inputs ``input_ids``, ``attention_mask``,
    ``token_type_ids``), one thread, batch 16 x 64 tokens (half the batch padded from token 40),
    the files called in turn in each round; per-round time ratio first file / each file."""
    import time

    import numpy as np

    from bench.suite.engines import ort_session

    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 20000, (16, 64)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[8:, 40:] = 0
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    runs = []
    for f in files:
        s = ort_session(f, optimize=True, threads=1)
        feed = {i.name: feeds[i.name] for i in s.get_inputs()}
        s.run(None, feed)  # warm-up
        runs.append((s, feed))
    times = np.zeros((rounds, len(files)))
    for r in range(rounds):
        for j, (s, feed) in enumerate(runs):
            t = time.perf_counter()
            s.run(None, feed)
            times[r, j] = time.perf_counter() - t
    out = {}
    for j, f in enumerate(files):
        ratio = times[:, 0] / times[:, j]
        out[f] = {"median_ms": float(np.median(times[:, j]) * 1e3),
                  "ratio": [float(np.median(ratio)), float(ratio.min()), float(ratio.max())]}  # fmt: skip
        log(f"{f}: {out[f]['median_ms']:.1f} ms; first / this per round {out[f]['ratio'][0]:.3f}"
            f" [{out[f]['ratio'][1]:.3f}-{out[f]['ratio'][2]:.3f}]")  # fmt: skip
    return out


def main(argv: list[str]) -> int:
    if argv == ["--tiny"]:
        tiny()
        return 0
    if argv[:1] == ["--ort-speed"]:
        ort_speed(argv[1:])
        return 0
    only_rows = None
    if "--rows" in argv:  # --rows a,b: only these quantbridge rows (a run adding rows to another)
        i = argv.index("--rows")
        # peers as tool:name; ";" separates when a row name holds commas (peers.BEST)
        only_rows = set(argv[i + 1].split(";" if ";" in argv[i + 1] else ","))
        argv = argv[:i] + argv[i + 2 :]
    import quantbridge as qb

    rows = _rows()
    if qb.Recipe.preset("default") == _default_before():  # the default row is the before
        rows.pop("default before")
    for name, factory in rows.items():
        peers.register_ours(name, factory)
    plain = peers.configs

    def configs(quick: bool, extra_ours: tuple[str, ...] = ()) -> list:
        out = plain(quick, extra_ours)
        for name in rows:
            where = ("minilm",) if name in MINILM_ONLY else None
            out.append(peers.Config("quantbridge", name, workloads=where))
        if only_rows is not None:
            # a quantbridge row by name, a peer's as tool:name (nncf:transformer)
            out = [
                c
                for c in out
                if (c.tool == "quantbridge" and c.name in only_rows)
                or f"{c.tool}:{c.name}" in only_rows
            ]
        return out

    peers.configs = configs
    return bench_main.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
